"""This machine's limits for the speed figures of docs/results/speed: GEMM throughput (a big square product, and the
products of SmolLM2's 30 layers at 1 and 17 rows on packed weights, as the static runtime runs them: 30 distinct
copies, so that the weights come from memory as in a real forward, not from the cache) and memory read bandwidth
(a sum over 1 GiB). Run it with nothing else running: `.venv/bin/python scripts/floors.py`."""
import json
import time

import torch

from treeflash.runtime.packed import linear, pack

LAYER = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # q|k|v, o, gate|up, down of SmolLM2-135M
LAYERS = 30


def best(f, repeats: int = 10) -> float:
    f()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        f()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    out = {"threads": torch.get_num_threads()}
    for dtype in (torch.bfloat16, torch.float32):
        name = str(dtype).removeprefix("torch.")
        a, b = torch.randn(2048, 2048, dtype=dtype), torch.randn(2048, 2048, dtype=dtype)
        out[f"gemm_2048_{name}_GFLOPs"] = 2 * 2048 ** 3 / best(lambda: a @ b) / 1e9
        weights = [(w, pack(w)) for _ in range(LAYERS) for w in (torch.randn(o, i, dtype=dtype) for o, i in LAYER)]
        params = sum(w.numel() for w, _ in weights)
        nbytes = params * weights[0][0].element_size()
        for rows in (1, 17):
            inputs = {n_in: torch.randn(rows, n_in, dtype=dtype) for _, n_in in LAYER}
            seconds = best(lambda: [linear(inputs[w.shape[1]], w, p) for w, p in weights])
            out[f"layers_{rows}rows_{name}_ms"] = 1e3 * seconds
            out[f"layers_{rows}rows_{name}_GFLOPs"] = 2 * rows * params / seconds / 1e9
            out[f"layers_{rows}rows_{name}_weights_GBps"] = nbytes / seconds / 1e9
    big = torch.ones(256 * 1024 * 1024)  # 1 GiB of fp32
    out["read_GBps"] = big.numel() * 4 / best(lambda: big.sum(), 5) / 1e9
    print(json.dumps({k: round(v, 1) for k, v in out.items()}))


if __name__ == "__main__":
    main()
