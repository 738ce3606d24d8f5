"""The decoder layers' 4-bit products of SmolLM2-135M with int8 activations (torchao's `da8w4` CPU kernel, the
way llama.cpp multiplies) against the kernels treeflash runs (issue 29: could int8 activations close the gap?).

Per row count, all 30 layers' products (fused q|k|v, o, gate|up, down) one after another, each layer's weights its
own (so that they stream from memory as in a forward): PyTorch's int4 kernel (bf16 activations, what the runtime
runs below 6 rows) and `da8w4`: the kernel alone on activations quantised beforehand, and with what a Q4_1 block
needs around it (per-row symmetric int8 quantisation of the activations, and the blocks' minimum times each
group's sum), eager. The dense bf16 products the runtime runs from 6 rows are `scripts/forward_costs.py`'s.
Q4_1 (q * d + m) maps onto `da8w4`'s integer zero points only through that extra term: the kernel runs with zero
points 0 and scales d. Weights are random 4-bit blocks of the model's shapes (speed does not depend on their
values); the LM head (Q8_0) is left out.
Also the relative error of each whole product against the fp32 product of the dequantised weights.

The kernel is not in torchao's PyPI wheels: build torchao from source with `USE_CPU_KERNELS=1`, or compile its
`torchao/csrc/cpu/aten_kernels/da8w4_linear.cpp` alone and pass the library with --load-library.

    .venv/bin/python scripts/da8w4_products.py [--load-library da8w4.so] [--out products.json]
"""

import argparse
import importlib
import json

import torch
from forward_costs import timed  # scripts/ is on the path when a script runs

from treeflash.runtime.int4 import Int4Weight, dequantise

ROWS = (1, 2, 4, 8, 17)
LAYERS = 30
SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}  # [N, K]
GROUP = 32


def define_ops() -> None:
    """torchao's schemas (torchao/ops.py), for a kernel library loaded without torchao's Python package."""
    global _LIBRARY  # the schemas last as long as this object
    lib = _LIBRARY = torch.library.Library("torchao", "DEF")
    lib.define("da8w4_linear_prepack_cpu(Tensor weight, Tensor scales, Tensor qzeros) -> (Tensor, Tensor, Tensor, "
               "Tensor)")
    lib.define("da8w4_linear_cpu(Tensor input, Tensor input_scales, Tensor input_qzeros, Tensor weight, "
               "Tensor weight_scales, Tensor weight_qzeros, Tensor compensation, Tensor? bias, "
               "ScalarType output_dtype) -> Tensor")


def q4_1_weight(n: int, k: int, gen: torch.Generator) -> dict:
    """A random Q4_1 weight: w = q * d + m per group of 32 inputs, in each kernel's layout."""
    g = k // GROUP
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=gen)
    d = torch.rand(n, g, generator=gen) * 0.01 + 0.001
    m = -8 * d + torch.randn(n, g, generator=gen) * 0.001
    zero = m + 8 * d  # the runtime's form: (q - 8) * d + zero
    da8w4 = torch.ops.torchao.da8w4_linear_prepack_cpu(q, d, torch.zeros(n, g, dtype=torch.int8))
    return dict(dense=dequantise(q, d, zero), int4=Int4Weight.from_ints(q, d, zero, torch.bfloat16), da8w4=da8w4,
                minimum=m.T.contiguous())  # fp32: a bf16 product this thin is 4x slower


def quantise_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Symmetric int8 per row, as `da8w4` takes it: values, scales [M, 1] fp32, zero points (unused) int32."""
    scale = x.float().abs().amax(-1, keepdim=True).clamp_min(1e-8) / 127
    return torch.round(x.float() / scale).to(torch.int8), scale, torch.zeros_like(scale, dtype=torch.int32)


def products(x: torch.Tensor, w: dict) -> dict:
    """The three ways of one product x [M, K] @ w.T, as callables."""
    xq = quantise_rows(x)  # for the kernel alone

    def q4_1():
        y = torch.ops.torchao.da8w4_linear_cpu(*quantise_rows(x), *w["da8w4"], None, torch.bfloat16)
        return y + (x.view(x.shape[0], -1, GROUP).sum(-1).float() @ w["minimum"]).to(y.dtype)
    return {"int4": lambda: w["int4"].matmul(x),
            "da8w4 kernel": lambda: torch.ops.torchao.da8w4_linear_cpu(*xq, *w["da8w4"], None, torch.bfloat16),
            "da8w4 + quantise + Q4_1 term": q4_1}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--load-library", help="a library with torchao's da8w4 CPU kernels (without torchao)")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", help="write the table as JSON here")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.load_library:
        define_ops()
        torch.ops.load_library(args.load_library)
    else:
        importlib.import_module("torchao.ops")  # its schemas; the kernels come with a USE_CPU_KERNELS=1 build
    if "CPU" not in torch._C._dispatch_dump("torchao::da8w4_linear_cpu"):
        raise SystemExit("torchao's da8w4 CPU kernel is not built here: see this script's help")

    gen = torch.Generator().manual_seed(0)
    layers = [{name: q4_1_weight(n, k, gen) for name, (n, k) in SHAPES.items()} for _ in range(LAYERS)]
    table = {}
    with torch.no_grad():
        for rows in ROWS:
            xs = {k: torch.randn(rows, k, generator=gen).to(torch.bfloat16) for k in {k for _, k in SHAPES.values()}}
            calls = [products(xs[SHAPES[name][1]], w) for layer in layers for name, w in layer.items()]
            errors = {}
            for name, w in layers[0].items():
                x = xs[SHAPES[name][1]]
                ref = x.float() @ w["dense"].T
                for kind, call in products(x, w).items():
                    if kind != "da8w4 kernel":  # without the Q4_1 term it is not the product
                        errors.setdefault(kind, []).append(((call().float() - ref).norm() / ref.norm()).item())
            row = {}
            for kind in calls[0]:
                error = errors.get(kind)
                row[kind] = {"ms": timed(lambda: [c[kind]() for c in calls], args.repeats),
                             "relative_error": sum(error) / len(error) if error else None}
            table[rows] = row
    kinds = list(table[ROWS[0]])
    print(f"ms for the {LAYERS} layers' products (median of {args.repeats}); relative error against fp32")
    print("| rows | " + " | ".join(kinds) + " |")
    print("|---" * (len(kinds) + 1) + "|")
    for rows, row in table.items():
        cells = [f"{row[k]['ms']:.2f}" + ("" if row[k]["relative_error"] is None
                                          else f" ({row[k]['relative_error']:.4f})") for k in kinds]
        print(f"| {rows} | " + " | ".join(cells) + " |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"threads": torch.get_num_threads(), "layers": LAYERS, "shapes": SHAPES,
                       "table": table}, f, indent=1)


if __name__ == "__main__":
    main()
