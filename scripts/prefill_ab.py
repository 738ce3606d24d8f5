"""A prompt's prefill on the static runtime: SDPA's causal kernel (what a prefill from position 0 runs) against the
same forward under an explicit causal mask with the grouped-query heads folded (what it ran before, and what every
other forward of several tokens runs). The default target as the command line loads it, alternating, per prompt.

    .venv/bin/python scripts/prefill_ab.py --dataset chat-dev --limit 10 [--out prefill.json]
"""

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from treeflash import Target
from treeflash.eval.datasets import load_prompts


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dataset", default="chat-dev")
    p.add_argument("--limit", type=int, default=10)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    target = Target.load(dtype="auto", compile="auto")  # the command line's defaults
    d = target.static
    rows = []
    with torch.inference_mode():
        for text in load_prompts(args.dataset, limit=args.limit):
            ids = torch.tensor([target.encode_prompt(text)])
            n = ids.shape[1]
            positions = torch.arange(n)[None]
            ways = {"causal": None, "masked": torch.ones(1, n, n, dtype=torch.bool).tril()}
            ms = {way: [] for way in ways}
            for _ in range(args.repeats):
                for way, allowed in ways.items():
                    start = time.perf_counter()
                    d.forward_batch(d.cache, 0, ids, positions, [0], allowed, logits_at=slice(-1, None))
                    ms[way].append(1e3 * (time.perf_counter() - start))
            row = {"tokens": n, **{f"{way}_ms": statistics.median(v) for way, v in ms.items()}}
            print(f"{n:5d} tokens: causal {row['causal_ms']:7.1f} ms, masked {row['masked_ms']:7.1f} ms "
                  f"(x{row['masked_ms'] / row['causal_ms']:.2f})", flush=True)
            rows.append(row)
    total = {way: sum(r[f"{way}_ms"] for r in rows) for way in ("causal", "masked")}
    print(f"all prompts: causal {total['causal']:.0f} ms, masked {total['masked']:.0f} ms "
          f"(x{total['masked'] / total['causal']:.2f})")
    if args.out:
        Path(args.out).write_text(json.dumps({"dataset": args.dataset, "dtype": str(target.dtype), "prompts": rows,
                                              "total_ms": total}, indent=1) + "\n")


if __name__ == "__main__":
    main()
