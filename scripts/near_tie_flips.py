"""Where a method's greedy output leaves `ar`'s on the fast (bf16, 4-bit) path, is it a near tie? Each method and
`ar` decode the dataset's first prompts with the command line's defaults; at the first token where they part, the
exact fp32 target (`--dtype float32`, the GGUF dequantised) scores both tokens after the common prefix. A near-tie
flip has the two tokens' fp32 logits a few hundredths apart (bf16 keeps 8 bits of mantissa: logits of 10-20 round
by 0.04-0.08); a bug would part at tokens far apart.

    python scripts/near_tie_flips.py --dataset gsm8k --methods ddtree,treeflash [--limit 10] [--out flips.json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from treeflash import Target, generate
from treeflash.drafters import make_drafter
from treeflash.eval.datasets import load_prompts


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dataset", default="gsm8k")
    p.add_argument("--methods", default="ddtree")
    p.add_argument("--limit", type=int, default=10)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    fast = Target.load(dtype="auto", compile="auto")  # the command line's defaults
    prompts = [fast.encode_prompt(text) for text in load_prompts(args.dataset, limit=args.limit)]
    ar = [generate(fast, make_drafter("ar"), prompt, args.max_new_tokens).tokens for prompt in prompts]
    parted = []  # (method, prompt index, position, ar's token, the method's token)
    for method in args.methods.split(","):
        drafter = make_drafter(method, fast)
        for i, prompt in enumerate(prompts):
            out = generate(fast, drafter, prompt, args.max_new_tokens).tokens
            at = next((j for j, (a, b) in enumerate(zip(ar[i], out)) if a != b), None)
            if at is not None:
                parted.append((method, i, at, ar[i][at], out[at]))
    del fast
    exact = Target.load(dtype="float32", quantize="none", compile="off", runtime="hf")
    rows = []
    for method, i, at, a, b in parted:
        logits = exact.prefill(prompts[i] + ar[i][:at]).logits[-1].float()
        top = logits.topk(2)
        rows.append({"method": method, "prompt": i, "position": at, "ar_token": a, "method_token": b,
                     "fp32_logit_gap": float(logits[a] - logits[b]),
                     "fp32_top2_gap": float(top.values[0] - top.values[1]),
                     "ar_token_rank": int((logits > logits[a]).sum()),
                     "method_token_rank": int((logits > logits[b]).sum())})
    print(f"{args.dataset}: {len(prompts)} prompts, {args.max_new_tokens} tokens; outputs that part from ar's:")
    for method in args.methods.split(","):
        mine = [r for r in rows if r["method"] == method]
        gaps = ", ".join(f"{r['fp32_logit_gap']:+.3f}" for r in mine)
        print(f"  {method}: {len(mine)} of {len(prompts)}; fp32 logit of ar's token minus the method's: {gaps or '-'}")
    if args.out:
        Path(args.out).write_text(json.dumps({"dataset": args.dataset, "prompts": len(prompts), "rows": rows}, indent=1)
                                  + "\n")


if __name__ == "__main__":
    main()
