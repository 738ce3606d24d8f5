"""Benchmark GDN tree verification: (a) per-branch replay, (b) per-node recurrence, (c) masked tree solve.

Trees are shaped like DDTree's: a best-first heap over per-depth top-k marginals. Reports the error of (b) and
(c) against (a), their times (fp32, median of a few repeats, same run), and the memory each needs for the
deferred commit: the (k, U, G) stash vs one full state per node.

    treeflash gdn-bench --tree-size 16,32,64,128 [--json]
"""

from __future__ import annotations

import heapq
import statistics
import time
from typing import Callable

import torch
import torch.nn.functional as F

from .recurrent import tree_verify_recurrent
from .reference import tree_verify_reference
from .state import normalize_qk
from .tree_solve import tree_verify_solve
from .tree_utils import depths, leaves
from .triton_tree import HAS_TRITON, tree_solve_triton


def ddtree_parents(size: int, max_depth: int = 16, topk: int = 8, vocab: int = 1000,
                   gen: torch.Generator | None = None) -> list[int]:
    """Parent list of a DDTree-shaped tree with `size` nodes (root included).

    Per depth, the drafter's marginal is a softmax of random logits with one boosted token (random peakiness); a node at depth d with
    sibling rank r scores the sum of its path's log-probs. Pop the best prefix, push its next sibling and its
    first child, stop at `size` nodes.
    """
    logps = []
    for _ in range(max_depth):
        logits = torch.randn(vocab, generator=gen)
        logits[0] += 5.0 + 6.0 * torch.rand((), generator=gen).item()  # the drafter's guess: top-1 p ~ 0.1..0.99
        logps.append(F.log_softmax(logits, -1).topk(topk).values.tolist())
    parents = [-1]
    heap = [(-logps[0][0], 1, 0, 0)]  # (-score, depth, sibling rank, parent node)
    while heap and len(parents) < size:
        neg, d, r, parent = heapq.heappop(heap)
        node, score = len(parents), -neg
        parents.append(parent)
        if r + 1 < topk:
            heapq.heappush(heap, (-(score - logps[d - 1][r] + logps[d - 1][r + 1]), d, r + 1, parent))
        if d < max_depth:
            heapq.heappush(heap, (-(score + logps[d][0]), d + 1, 0, node))
    return parents


def gdn_inputs(T: int, heads: int, dk: int, dv: int, gen: torch.Generator, device: str = "cpu"):
    """Random layer inputs with Qwen3-Next-like gates: g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b)."""
    q, k = normalize_qk(torch.randn(T, heads, dk, generator=gen), torch.randn(T, heads, dk, generator=gen))
    v = torch.randn(T, heads, dv, generator=gen)
    A_log = torch.log(torch.rand(heads, generator=gen) * 16 + 1e-3)
    g = -A_log.exp() * F.softplus(torch.randn(T, heads, generator=gen) + 1.0)
    beta = torch.sigmoid(torch.randn(T, heads, generator=gen))
    S0 = torch.randn(heads, dk, dv, generator=gen) * dk**-0.5
    return tuple(t.to(device) for t in (q, k, v, g, beta, S0))


def median_ms(fn: Callable[[], object], repeats: int, device: str) -> float:
    times = []
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def run_bench(sizes=(16, 32, 64, 128), heads: int = 32, dk: int = 128, dv: int = 128, repeats: int = 3,
              seed: int = 0, device: str | None = None) -> dict:
    """{"sizes": {"T": {...}}} with errors vs (a), times in ms, speedups of (c) and memory per layer."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for T in sizes:
        parents = ddtree_parents(T, gen=gen)
        inputs = gdn_inputs(T, heads, dk, dv, gen, device)
        impls = {"branch_recurrent": tree_verify_reference, "node_recurrent": tree_verify_recurrent,
                 "tree_solve": tree_verify_solve}
        if device == "cuda" and HAS_TRITON:
            impls["triton"] = tree_solve_triton
        results = {name: fn(*inputs, parents) for name, fn in impls.items()}  # also the warm-up
        o_ref = results["branch_recurrent"][0]
        errs = {name: (o - o_ref).abs().max().item() for name, (o, _) in results.items() if name != "branch_recurrent"}
        del results
        pool = torch.empty(T, heads, dk, dv, device=device)  # preallocated, as servers do
        impls["node_recurrent"] = lambda *a: tree_verify_recurrent(*a, states=pool)
        ms = {name: median_ms(lambda fn=fn: fn(*inputs, parents), repeats, device) for name, fn in impls.items()}
        del pool
        row = {
            "max_abs_err": max(errs["node_recurrent"], errs["tree_solve"]),
            "speedup_vs_branch_recurrent": ms["branch_recurrent"] / ms["tree_solve"],
            "speedup_vs_node_recurrent": ms["node_recurrent"] / ms["tree_solve"],
            "err_node_recurrent": errs["node_recurrent"], "err_tree_solve": errs["tree_solve"],
            **{f"{name}_ms": t for name, t in ms.items()},
            "nodes": T, "depth": max(depths(parents)), "leaves": len(leaves(parents)),
            "stash_bytes": T * heads * (dk + dv + 1) * 4,  # k, U, G per node, fp32
            "full_state_bytes": T * heads * dk * dv * 4,  # one state per node, as servers keep today
            "device": device, "threads": torch.get_num_threads(),
        }
        if "triton" in ms:
            row.update(err_triton=errs["triton"], speedup_triton_vs_node_recurrent=ms["node_recurrent"] / ms["triton"])
        out[str(T)] = row
    return {"sizes": out}


def format_table(result: dict) -> str:
    head = (f"{'T':>4} {'depth':>5} {'leaves':>6} {'branch ms':>10} {'node ms':>9} {'solve ms':>9} "
            f"{'x branch':>8} {'x node':>7} {'err node':>9} {'err solve':>9} {'stash KiB':>9} {'states MiB':>10}")
    lines = [head]
    for T, r in result["sizes"].items():
        lines.append(f"{T:>4} {r['depth']:>5} {r['leaves']:>6} {r['branch_recurrent_ms']:>10.2f} "
                     f"{r['node_recurrent_ms']:>9.2f} {r['tree_solve_ms']:>9.2f} "
                     f"{r['speedup_vs_branch_recurrent']:>8.1f} {r['speedup_vs_node_recurrent']:>7.1f} "
                     f"{r['err_node_recurrent']:>9.1e} {r['err_tree_solve']:>9.1e} "
                     f"{r['stash_bytes'] / 2**10:>9.0f} {r['full_state_bytes'] / 2**20:>10.0f}")
        if "triton_ms" in r:
            lines[-1] += f"  triton {r['triton_ms']:.3f} ms (x node {r['speedup_triton_vs_node_recurrent']:.1f})"
    first = next(iter(result["sizes"].values()), {})
    lines.append(f"fp32, device {first.get('device')}, {first.get('threads')} torch threads; "
                 "x = speedup of the tree solve; memory per layer for the deferred commit")
    return "\n".join(lines)
