"""The 4-bit LM head on the int4 kernel against its dense copy at one row: `ar` decoding of the default target as the
command line runs it (bf16, the GGUF's blocks, compiled), both layouts in one process, interleaved prompt by prompt.

The compiled runtime measures which layout is faster from how many rows (`runtime/crossover.py`); this sets the
head's rule by hand to the fixed DENSE_ROWS (the kernel up to 5 rows) and to 1 (the dense copy always), and times
plain decoding with each.

    .venv/bin/python scripts/head_layout_ab.py --dataset gsm8k --limit 10 [--out ab.json]
"""

import argparse
import json
import statistics
import time
from pathlib import Path

from treeflash import Target, generate
from treeflash.drafters import make_drafter
from treeflash.eval.datasets import load_prompts
from treeflash.runtime.static_decoder import DENSE_ROWS


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dataset", default="gsm8k")
    p.add_argument("--limit", type=int, default=10)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    target = Target.load(dtype="bfloat16", compile="on")
    head = target.static.lm_head
    rules = {"kernel": DENSE_ROWS[target.dtype], "dense": 1}
    print(f"measured on this machine: the dense copy from {head.dense_rows} rows")
    ar = make_drafter("ar")
    prompts = [target.encode_prompt(text) for text in load_prompts(args.dataset, limit=args.limit)]
    ms = {name: [] for name in rules}  # ms per new token, one entry per prompt and repeat
    same = 0
    for _ in range(args.repeats):
        for prompt in prompts:
            tokens = {}
            for name, rows in rules.items():
                head.dense_rows = rows
                start = time.perf_counter()
                out = generate(target, ar, prompt, max_new_tokens=args.max_new_tokens)
                ms[name].append(1e3 * (time.perf_counter() - start) / len(out.tokens))
                tokens[name] = out.tokens
            same += tokens["kernel"] == tokens["dense"]
    ratios = [k / d for k, d in zip(ms["kernel"], ms["dense"])]
    report = {"dataset": args.dataset, "prompts": len(prompts), "repeats": args.repeats,
              "median_ms_per_token": {name: statistics.median(v) for name, v in ms.items()},
              "median_speedup_dense": statistics.median(ratios), "same_tokens": f"{same}/{len(ratios)}", "ms": ms}
    print(f"ms per token (median over prompts): kernel {report['median_ms_per_token']['kernel']:.2f}, dense "
          f"{report['median_ms_per_token']['dense']:.2f}; dense {report['median_speedup_dense']:.3f}x faster; "
          f"the same tokens on {report['same_tokens']} runs")
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
