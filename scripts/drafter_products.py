"""The DFlash drafter's twelve products (3 layers: q|k|v, o, gate|up, down) at a few row counts, four ways: F.linear
on bf16 weights (what the compiled block runs), oneDNN-packed bf16 (`runtime/packed.py`, the eager drafter's),
torch.compile over F.linear, and the target's int4 kernel; warm, and cold (a 160 MB buffer streamed between calls, as
a target step does before a drafting round). Random weights: the time depends on the shapes only.

    python scripts/drafter_products.py
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F

from treeflash.runtime import packed
from treeflash.runtime.int4 import Int4Weight, quantise

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 3  # SmolLM2's drafter, [out, in]


def main() -> None:
    torch.manual_seed(0)
    weights = [0.02 * torch.randn(o, i).bfloat16() for o, i in SHAPES]
    packs = [packed.pack(w) for w in weights]
    int4 = [Int4Weight.from_ints(*quantise(w.float()), torch.bfloat16) for w in weights]
    big = torch.ones(40_000_000)  # 160 MB: more than the caches
    compiled = torch.compile(lambda xs, ws: [F.linear(x, w) for x, w in zip(xs, ws)], options={"cpp_wrapper": True})

    def median_ms(f, cold: bool, n: int = 60) -> float:
        times = []
        for _ in range(n):
            if cold:
                big.add_(1.0)
            start = time.perf_counter()
            f()
            times.append(time.perf_counter() - start)
        return 1e3 * statistics.median(times)

    print("rows  cache  F.linear  packed  compiled  int4  (ms, all twelve)")
    with torch.no_grad():
        for rows in (1, 5, 16):
            xs = [torch.randn(rows, w.shape[1]).bfloat16() for w in weights]
            ways = (lambda: [F.linear(x, w) for x, w in zip(xs, weights)],
                    lambda: [packed.packed_linear(x, p) for x, p in zip(xs, packs)],
                    lambda: compiled(xs, weights),
                    lambda: [q.matmul(x) for x, q in zip(xs, int4)])
            for f in ways:
                f(), f()
            for cold in (False, True):
                cells = "  ".join(f"{median_ms(f, cold):6.3f}" for f in ways)
                print(f"{rows:4d}  {'cold' if cold else 'warm'}  {cells}")


if __name__ == "__main__":
    main()
