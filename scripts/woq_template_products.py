"""Inductor's weight-only int4 GEMM template against PyTorch's int4 kernel, over the 120 products of SmolLM2's 30
decoder layers (random Q4 weights of its shapes), each side one AOTInductor package per row count.

The template needs the weights frozen into the graph (parameters of the exported module, `freezing`,
`max_autotune` with the CPP backend): one package per model, holding its weights. This measures what it would buy.

    .venv/bin/python scripts/woq_template_products.py --rows 1 2 4 8 [--out products.json]
"""

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
import torch._inductor.config as inductor_config
from forward_costs import timed  # scripts/ is on the path when a script runs

from treeflash.runtime.int4 import GROUP, Int4Weight, quantise

LAYER = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # q|k|v, o, gate|up, down: [out, in]
LAYERS = 30
TEMPLATE = {"freezing": True, "max_autotune": True, "max_autotune_gemm_backends": "CPP"}


class Products(torch.nn.Module):
    """Every product of the layers, each on its own input width, as parameters (what freezing folds in)."""

    def __init__(self, weights: list[Int4Weight]):
        super().__init__()
        self.packed = torch.nn.ParameterList([torch.nn.Parameter(w.packed, requires_grad=False) for w in weights])
        self.scales = torch.nn.ParameterList([torch.nn.Parameter(w.scale_zeros, requires_grad=False)
                                              for w in weights])

    def forward(self, narrow: torch.Tensor, wide: torch.Tensor) -> list[torch.Tensor]:
        return [torch.ops.aten._weight_int4pack_mm_for_cpu(wide if p.shape[1] * 2 == wide.shape[1] else narrow, p,
                                                           GROUP, s) for p, s in zip(self.packed, self.scales)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    torch.manual_seed(0)
    weights = [Int4Weight.from_ints(*quantise(0.05 * torch.randn(n, k)), torch.bfloat16)
               for _ in range(LAYERS) for n, k in LAYER]
    module = Products(weights).eval()
    results = []
    with tempfile.TemporaryDirectory() as tmp, torch.no_grad():
        for rows in args.rows:
            inputs = [torch.randn(rows, 576, dtype=torch.bfloat16), torch.randn(rows, 1536, dtype=torch.bfloat16)]
            runs, compile_s = {}, {}
            for name, options in (("kernel", {}), ("template", TEMPLATE)):
                program = torch.export.export(module, tuple(inputs), strict=False)
                start = time.time()
                with inductor_config.patch(options):
                    path = torch._inductor.aoti_compile_and_package(program,
                                                                    package_path=str(Path(tmp) / f"{name}.pt2"))
                compile_s[name] = time.time() - start
                runs[name] = torch._inductor.aoti_load_package(path).loader.run
            diff = max((a.float() - b.float()).abs().max().item()
                       for a, b in zip(runs["kernel"](inputs), runs["template"](inputs)))
            ms = {name: [timed(lambda: run(inputs), args.repeats) for _ in range(2)] for name, run in runs.items()}
            row = {"rows": rows, "kernel_ms": ms["kernel"], "template_ms": ms["template"], "max_abs_diff": diff,
                   "compile_s": compile_s}
            print(f"{rows} rows: kernel {min(ms['kernel']):.2f} ms, template {min(ms['template']):.2f} ms "
                  f"(x{min(ms['template']) / min(ms['kernel']):.2f}), compile {compile_s['kernel']:.0f} s / "
                  f"{compile_s['template']:.0f} s, max |diff| {diff:.3g}", flush=True)
            results.append(row)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
