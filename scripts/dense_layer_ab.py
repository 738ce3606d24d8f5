"""The compiled layer on the dense copies against the old rule (the 4-bit kernel's compiled layer up to
COMPILED_ROWS rows, eager beyond), on the default target as the command line runs it (bf16, the GGUF's blocks,
compiled), both rules in one process:

1. one verify of n rows (a bushy tree) after 200 and 1,200 positions;
2. batched plain decoding (`BatchEngine`, B sequences at a time: B rows a step), interleaved by repeat;
3. single-sequence decoding with `--budget auto`, interleaved prompt by prompt (the policy prices trees at the
   costs of the rule in force: a target per rule, each with its own policy).

    .venv/bin/python scripts/dense_layer_ab.py --dataset gsm8k --limit 10 [--out ab.json]
"""

import argparse
import json
import statistics
import time
from pathlib import Path

from forward_costs import bushy, verify_ms
from treeflash import Target, generate
from treeflash.batching import BatchEngine
from treeflash.drafters import make_drafter
from treeflash.eval.datasets import load_prompts
from treeflash.runtime.static_decoder import COMPILED_ROWS

ROWS = (1, 2, 4, 5, 8, 12, 17, 32)
CONTEXTS = (200, 1200)


def use(target: Target, rule: str, measured: tuple[int, int]) -> None:
    """Set the target's layers to the old rule or to the new (measured) one."""
    static = target.static
    static.int4_rows, static.compiled_rows = (COMPILED_ROWS, COMPILED_ROWS) if rule == "old" else measured


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dataset", default="gsm8k")
    p.add_argument("--limit", type=int, default=10)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[4, 8])
    p.add_argument("--methods", default="ar,rest,ddtree")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    texts = load_prompts(args.dataset, limit=args.limit)
    targets = {rule: Target.load(dtype="bfloat16", compile="on") for rule in ("old", "new")}
    measured = (targets["new"].static.int4_rows, targets["new"].static.compiled_rows)
    use(targets["old"], "old", measured)
    print(f"measured on this machine: the 4-bit layer up to {measured[0]} rows, the dense one up to {measured[1]}")
    report: dict = {"dataset": args.dataset, "int4_rows": measured[0], "compiled_rows": measured[1],
                    "verify_ms": [], "batched": [], "single": {}}

    for context in CONTEXTS:
        tokens = [1000 + i % 500 for i in range(context)]
        for rows in ROWS:
            ms = {rule: verify_ms(target, tokens, bushy(5, rows)) for rule, target in targets.items()}
            report["verify_ms"].append({"context": context, "rows": rows, **ms})
            print(f"verify {rows:2d} rows after {context}: old {ms['old']:.2f} ms, new {ms['new']:.2f} ms", flush=True)

    prompts = [targets["old"].encode_prompt(text) for text in texts]
    ar = make_drafter("ar")
    for batch in args.batch_sizes:
        seconds = {rule: [] for rule in targets}
        for _ in range(args.repeats):
            for rule, target in targets.items():
                start = time.perf_counter()
                results = BatchEngine(target, ar, max_batch=batch).run(prompts, args.max_new_tokens)
                seconds[rule].append(time.perf_counter() - start)
                new = sum(len(r.tokens) for r in results)
        tps = {rule: new / statistics.median(s) for rule, s in seconds.items()}
        report["batched"].append({"batch": batch, "tokens": new, "tokens_per_s": tps})
        print(f"ar, batches of {batch}: old {tps['old']:.1f} tokens/s, new {tps['new']:.1f} "
              f"({tps['new'] / tps['old']:.3f}x)", flush=True)

    for method in args.methods.split(","):
        drafters = {rule: make_drafter(method, target) for rule, target in targets.items()}  # a policy each
        ms = {rule: [] for rule in targets}
        same = 0
        for _ in range(args.repeats):
            for prompt in prompts:
                tokens = {}
                for rule, target in targets.items():
                    start = time.perf_counter()
                    out = generate(target, drafters[rule], prompt, max_new_tokens=args.max_new_tokens)
                    ms[rule].append(1e3 * (time.perf_counter() - start) / len(out.tokens))
                    tokens[rule] = out.tokens
                same += tokens["old"] == tokens["new"]
        ratio = statistics.median(o / n for o, n in zip(ms["old"], ms["new"]))
        report["single"][method] = {"median_ms_per_token": {r: statistics.median(v) for r, v in ms.items()},
                                    "median_speedup_new": ratio, "same_tokens": f"{same}/{len(ms['old'])}"}
        print(f"{method}: ms a token old {statistics.median(ms['old']):.2f}, new {statistics.median(ms['new']):.2f}; "
              f"new {ratio:.3f}x; the same tokens on {same}/{len(ms['old'])} runs", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
