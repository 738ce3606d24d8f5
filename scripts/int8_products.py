"""Would fbgemm's dynamic int8 products beat PyTorch's int4 kernel for the default target? (issue #29, AVX2 CPUs)

Every product of one SmolLM2-135M forward (30 layers of q, k, v, o, gate, up, down, and the 49,152-row LM head), at
n rows, back to back, on random weights of those shapes:
- `aten._weight_int4pack_mm_for_cpu`, bf16 activations, group 32 (what the GGUF runtime calls);
- `torch.ao.nn.quantized.dynamic.Linear` (fbgemm: int8 per-channel weights, activations quantised per call).

The int8 weights are not the GGUF's: a per-channel int8 copy of group-32 4-bit weights rounds them again, so the
model would change (near-tie flips), and torch 2.13 deprecates the quantised tensors this module is built on.

    .venv/bin/python scripts/int8_products.py [--out products.json]
"""

import argparse
import json
import warnings

import torch
from forward_costs import timed  # scripts/ is on the path when a script runs

from treeflash.runtime.int4 import Int4Weight, quantise

# [out, in] of q, k, v, o, gate, up, down: distinct products, as the int4 runtime runs them (floors.py fuses some)
LAYER = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)]
LAYERS, HEAD = 30, (49152, 576)
ROWS = (1, 4, 8, 17)


def int8_linear(w: torch.Tensor) -> torch.nn.Module:
    m = torch.ao.nn.quantized.dynamic.Linear(w.shape[1], w.shape[0], bias_=False)
    scale = w.abs().amax(1) / 127
    m.set_weight_bias(torch.quantize_per_channel(w, scale, torch.zeros(len(w), dtype=torch.long), 0, torch.qint8), None)
    return m


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the table as JSON")
    args = parser.parse_args()
    warnings.filterwarnings("ignore", message=".*quantize_per_tensor.*")
    torch.manual_seed(0)
    weights = [0.02 * torch.randn(n, k) for n, k in LAYER + [HEAD]]
    int4 = [Int4Weight.from_ints(*quantise(w), torch.bfloat16) for w in weights]
    int8 = [int8_linear(w) for w in weights]

    def products(kernels, rows, dtype, run):
        xs = {k: torch.randn(rows, k).to(dtype) for k in (576, 1536)}
        per_layer = list(zip(kernels[:-1], LAYER))

        def forward():
            for _ in range(LAYERS):
                for kernel, (_, k) in per_layer:
                    run(kernel, xs[k])
            run(kernels[-1], xs[576])
        return forward

    def int4_mm(w, x):
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, w.packed, w.group, w.scale_zeros)

    table = []
    print(f"{'rows':>4} {'int4 kernel ms':>15} {'fbgemm int8 ms':>15}")
    for rows in ROWS:
        a = timed(products(int4, rows, torch.bfloat16, int4_mm))
        b = timed(products(int8, rows, torch.float32, lambda m, x: m(x)))
        table.append({"rows": rows, "int4_ms": a, "int8_dynamic_ms": b})
        print(f"{rows:>4} {a:>15.1f} {b:>15.1f}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"threads": torch.get_num_threads(), "products": table}, f, indent=1)


if __name__ == "__main__":
    main()
