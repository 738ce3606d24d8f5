"""This machine's limits for the speed figures of docs/results/speed: GEMM throughput (a big square product, and the
products of one SmolLM2 layer at 1 and 17 rows on packed weights, as the static runtime runs them) and memory read
bandwidth (a sum over 1 GiB). Run it with nothing else running: `.venv/bin/python scripts/floors.py`."""
import json
import time

import torch

from treeflash.models.packed import linear, pack

LAYER = ((1344, 576), (576, 576), (3072, 576), (576, 1536))  # q|k|v, o, gate|up, down of SmolLM2-135M


def best(f, repeats: int = 10) -> float:
    f()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        f()
        times.append(time.perf_counter() - start)
    return min(times)


out = {"threads": torch.get_num_threads()}
for dtype in (torch.bfloat16, torch.float32):
    name = str(dtype).removeprefix("torch.")
    a, b = torch.randn(2048, 2048, dtype=dtype), torch.randn(2048, 2048, dtype=dtype)
    out[f"gemm_2048_{name}_GFLOPs"] = 2 * 2048 ** 3 / best(lambda: a @ b) / 1e9
    for rows in (1, 17):
        flops, seconds = 0, 0.0
        for n_out, n_in in LAYER:
            w = torch.randn(n_out, n_in, dtype=dtype)
            p, x = pack(w), torch.randn(rows, n_in, dtype=dtype)
            flops += 2 * rows * n_out * n_in
            seconds += best(lambda: linear(x, w, p), 50)
        out[f"layer_{rows}rows_{name}_us"] = 1e6 * seconds
        out[f"layer_{rows}rows_{name}_GFLOPs"] = flops / seconds / 1e9
big = torch.ones(256 * 1024 * 1024)  # 1 GiB of fp32
out["read_GBps"] = big.numel() * 4 / best(lambda: big.sum(), 5) / 1e9
print(json.dumps({k: round(v, 1) for k, v in out.items()}))
