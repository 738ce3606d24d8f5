"""A part of the compiled 4-bit path against the runtime without it, on the default target as the command line runs
it (bf16, the GGUF's blocks, compiled), both in one process:
- `--part sdpa`: trees of SDPA_ROWS rows and more attend by SDPA's kernel (without: the two fused reductions for
  every row count);
- `--part head`: the final norm and the 4-bit LM head compiled (without: eager);
- `--part prologue`: the embeddings, RoPE's tables and cache columns before the layers compiled (without: eager);
- several, comma-separated: the runtime without all of them.

1. one verify of n rows (a bushy tree) after each context length, the two interleaved;
2. single-sequence decoding with `--budget auto` at `--temperature` (each prompt its own seed, the same for both),
   interleaved prompt by prompt (a target each, each with its own policy, which prices trees at its own costs).

    .venv/bin/python scripts/compiled_parts_ab.py --part sdpa --dataset gsm8k --limit 10 [--out ab.json]
"""

import argparse
import json
import statistics
import time
from pathlib import Path

from forward_costs import bushy, verify_ms
from treeflash import Target, generate
from treeflash.drafters import make_drafter
from treeflash.eval.datasets import load_prompts
from treeflash.verify import Sampling

ROWS = (1, 2, 3, 4, 5, 6)
CONTEXTS = (150, 300, 600, 1200)
NEVER = 1 << 30  # sdpa_rows without SDPA: no tree attends by it on the 4-bit layer


def remove(target: Target, parts: str) -> None:
    """The target's runtime without `parts` (comma-separated)."""
    for part in parts.split(","):
        if part == "sdpa":
            target.static.sdpa_rows = NEVER
        elif part in ("head", "prologue"):
            setattr(target.static, f"compiled_{part}", None)
        else:
            raise SystemExit(f"unknown part {part!r}: choose from sdpa, head, prologue")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--part", required=True, help="sdpa, head or prologue, or several (comma-separated)")
    p.add_argument("--dataset", default="gsm8k")
    p.add_argument("--limit", type=int, default=10)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--methods", default="ar,pld,rest,ddtree")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--no-verifies", action="store_true", help="skip part 1")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    texts = load_prompts(args.dataset, limit=args.limit)
    targets = {rule: Target.load(dtype="bfloat16", compile="on") for rule in ("without", "with")}
    remove(targets["without"], args.part)
    report: dict = {"part": args.part, "dataset": args.dataset, "temperature": args.temperature,
                    "sdpa_rows": targets["with"].static.sdpa_rows,
                    "verify_ms": [], "single": {}}

    for context in () if args.no_verifies else CONTEXTS:
        tokens = [1000 + i % 500 for i in range(context)]
        for rows in ROWS:
            runs = {rule: [] for rule in targets}
            for k in range(4):  # interleaved, each first in turn: the machine's drift hits both
                for rule in ("without", "with") if k % 2 == 0 else ("with", "without"):
                    runs[rule].append(verify_ms(targets[rule], tokens, bushy(5, rows)))
            ms = {rule: statistics.median(v) for rule, v in runs.items()}
            report["verify_ms"].append({"context": context, "rows": rows, **ms})
            print(f"verify {rows} rows after {context}: without {ms['without']:.2f} ms, with {ms['with']:.2f} ms "
                  f"({ms['with'] / ms['without']:.3f}x)", flush=True)

    prompts = [targets["with"].encode_prompt(text) for text in texts]
    for method in args.methods.split(","):
        drafters = {rule: make_drafter(method, target) for rule, target in targets.items()}  # a policy each
        seconds = {rule: 0.0 for rule in targets}
        new = {rule: 0 for rule in targets}
        same = runs = 0
        for repeat in range(args.repeats):
            for i, prompt in enumerate(prompts):
                tokens = {}
                # each goes first on every other prompt: what runs second finds the machine as the first left it
                for rule in ("without", "with") if (i + repeat) % 2 == 0 else ("with", "without"):
                    target = targets[rule]
                    start = time.perf_counter()
                    out = generate(target, drafters[rule], prompt, args.max_new_tokens,
                                   Sampling(temperature=args.temperature), seed=i)  # the same seed for both
                    seconds[rule] += time.perf_counter() - start
                    new[rule] += len(out.tokens)
                    tokens[rule] = out.tokens
                same += tokens["without"] == tokens["with"]
                runs += 1
        tps = {rule: new[rule] / seconds[rule] for rule in targets}
        report["single"][method] = {"tokens_per_s": tps, "speedup": tps["with"] / tps["without"],
                                    "same_tokens": f"{same}/{runs}"}
        print(f"{method}: tokens/s without {tps['without']:.1f}, with {tps['with']:.1f} "
              f"({tps['with'] / tps['without']:.3f}x); the same tokens on {same}/{runs} runs", flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
