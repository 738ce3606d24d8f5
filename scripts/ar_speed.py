"""Plain decoding's speed in a fresh process, on the default target as the command line runs it: 10 GSM8K prompts,
128 new tokens each. For comparisons across processes (another checkout on PYTHONPATH, a compiled part removed),
which the machine's spread between processes (up to ±10 % here) makes noisy: run many, alternating.

    .venv/bin/python scripts/ar_speed.py LABEL [--without head,prologue]   # (parts as compiled_parts_ab.py names them)
    PYTHONPATH=/tmp/old/src .venv/bin/python scripts/ar_speed.py old   # an older checkout (git worktree)
"""

import argparse
import time

from compiled_parts_ab import remove
from treeflash import Target, generate
from treeflash.drafters import make_drafter
from treeflash.eval.datasets import load_prompts


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("label")
    p.add_argument("--without", default="", help="compiled parts to remove: sdpa, head, prologue (comma-separated)")
    p.add_argument("--dataset", default="gsm8k")
    args = p.parse_args()
    target = Target.load(dtype="bfloat16", compile="auto")
    if args.without:
        remove(target, args.without)
    prompts = [target.encode_prompt(text) for text in load_prompts(args.dataset, limit=10)]
    ar = make_drafter("ar")
    generate(target, ar, prompts[0], max_new_tokens=16)  # warm
    tokens, decoding, start = 0, 0.0, time.perf_counter()
    for prompt in prompts:
        out = generate(target, ar, prompt, max_new_tokens=128)
        tokens += len(out.tokens)
        decoding += sum(r.draft_s + r.verify_s for r in out.rounds)
    print(f"{args.label} tok/s {tokens / (time.perf_counter() - start):.1f} decode ms/token "
          f"{1e3 * decoding / tokens:.3f}")


if __name__ == "__main__":
    main()
