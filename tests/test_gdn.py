"""GDN tree verification: (b) recurrent, (c) tree solve and its Triton kernel all equal (a) the per-path replay;
the deferred commits equal the state replayed along the accepted path; the tree conv equals the per-path conv."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is first imported: run the kernel on CPU

import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from treeflash.gdn import (commit_conv_state, commit_state, gdn_tree_verify, normalize_qk, path_to,
                           tree_conv1d, tree_conv1d_reference, tree_verify_recurrent, tree_verify_reference,
                           tree_verify_solve)
from treeflash.gdn import triton_tree
from treeflash.gdn.reference import gdn_step

ATOL = 2e-5
FAST = settings(max_examples=25, deadline=None)


@st.composite
def parent_lists(draw, max_size: int = 150) -> list[int]:
    """Random trees, plus the extreme shapes: chains, stars and wide-then-deep combs."""
    T = draw(st.integers(1, max_size))
    shape = draw(st.sampled_from(["random", "chain", "star", "recent"]))
    if shape == "chain":
        return list(range(-1, T - 1))
    if shape == "star":
        return [-1] + [0] * (T - 1)
    lo = (lambda i: max(0, i - 3)) if shape == "recent" else (lambda i: 0)  # "recent" gives deep, narrow trees
    return [-1] + [draw(st.integers(lo(i), i - 1)) for i in range(1, T)]


def random_tree(T: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [-1] + [rng.randrange(max(0, i - 4), i) for i in range(1, T)]


def gdn_inputs(T: int, H: int = 2, dk: int = 8, dv: int = 8, seed: int = 0, g_min: float = -3.0):
    gen = torch.Generator().manual_seed(seed)
    q, k = normalize_qk(torch.randn(T, H, dk, generator=gen), torch.randn(T, H, dk, generator=gen))
    v = torch.randn(T, H, dv, generator=gen)
    g = torch.rand(T, H, generator=gen) * g_min  # log decay in [g_min, 0]
    beta = torch.rand(T, H, generator=gen)
    S0 = torch.randn(H, dk, dv, generator=gen)
    return q, k, v, g, beta, S0


def replay(inputs, path: list[int]) -> torch.Tensor:
    """The state after the plain sequential recurrence over `path`."""
    q, k, v, g, beta, S = inputs
    for i in path:
        S, _, _ = gdn_step(S, q[i], k[i], v[i], g[i], beta[i])
    return S


# ---- (b) and (c) against (a) -------------------------------------------------------------------------------
@FAST
@given(parents=parent_lists(), seed=st.integers(0, 2**16))
def test_recurrent_and_solve_match_reference(parents, seed):
    inputs = gdn_inputs(len(parents), seed=seed)
    o_ref, s_ref = tree_verify_reference(*inputs, parents)
    for o, stash in (tree_verify_recurrent(*inputs, parents), tree_verify_solve(*inputs, parents),
                     tree_verify_solve(*inputs, parents, block=16)):  # small blocks: many off-diagonal blocks
        torch.testing.assert_close(o, o_ref, atol=ATOL, rtol=0)
        torch.testing.assert_close(stash.U, s_ref.U, atol=ATOL, rtol=0)
        torch.testing.assert_close(stash.G, s_ref.G, atol=ATOL, rtol=0)


@pytest.mark.parametrize("parents", [list(range(-1, 199)), [-1] + [0] * 199, random_tree(200), random_tree(65)],
                         ids=["chain200", "star200", "tree200", "tree65"])
def test_solve_beyond_one_chunk(parents):
    inputs = gdn_inputs(len(parents), H=3, dk=16, dv=12)
    o_ref, _ = tree_verify_reference(*inputs, parents)
    torch.testing.assert_close(tree_verify_solve(*inputs, parents)[0], o_ref, atol=ATOL, rtol=0)


@pytest.mark.parametrize("parents", [list(range(-1, 99)), random_tree(100, seed=3)], ids=["chain", "tree"])
def test_strong_decay_stays_finite_and_accurate(parents):
    # g down to -20 per step: path gates reach about -2000, where e^{G} alone underflows to 0
    inputs = gdn_inputs(len(parents), g_min=-20.0, seed=5)
    o_ref, _ = tree_verify_reference(*inputs, parents)
    o, stash = tree_verify_solve(*inputs, parents)
    assert torch.isfinite(o).all() and torch.isfinite(stash.U).all()
    torch.testing.assert_close(o, o_ref, atol=ATOL, rtol=0)
    leaf = len(parents) - 1
    torch.testing.assert_close(commit_state(stash, inputs[-1], leaf), replay(inputs, path_to(parents, leaf)),
                               atol=ATOL, rtol=0)


# ---- deferred commit ---------------------------------------------------------------------------------------
@FAST
@given(parents=parent_lists(max_size=40), seed=st.integers(0, 2**16), data=st.data())
def test_commit_state_equals_replay(parents, seed, data):
    inputs = gdn_inputs(len(parents), seed=seed)
    node = data.draw(st.integers(0, len(parents) - 1))
    expected = replay(inputs, path_to(parents, node))
    _, stash_b = tree_verify_recurrent(*inputs, parents)
    torch.testing.assert_close(stash_b.states[node], expected, atol=ATOL, rtol=0)
    for impl in (tree_verify_reference, tree_verify_recurrent, tree_verify_solve):
        _, stash = impl(*inputs, parents)
        torch.testing.assert_close(commit_state(stash, inputs[-1], node), expected, atol=ATOL, rtol=0)
    # the path form gives the same state; the empty path keeps S0
    torch.testing.assert_close(commit_state(stash, inputs[-1], path_to(parents, node)), expected, atol=ATOL, rtol=0)
    assert torch.equal(commit_state(stash, inputs[-1], []), inputs[-1])


def test_commit_rejects_a_non_path():
    inputs = gdn_inputs(3)
    _, stash = tree_verify_solve(*inputs, [-1, 0, 0])
    with pytest.raises(ValueError):
        commit_state(stash, inputs[-1], [0, 1, 2])


def test_bad_parents_rejected():
    inputs = gdn_inputs(3)
    for bad in ([0, 0, 1], [-1, 2, 0], [-1, 0, 2]):
        with pytest.raises(ValueError):
            tree_verify_solve(*inputs, bad)


# ---- helpers and dispatch ----------------------------------------------------------------------------------
def test_normalize_qk_matches_hf_fallback():
    q, k = torch.randn(5, 2, 16), torch.randn(5, 2, 16)
    qn, kn = normalize_qk(q, k)
    torch.testing.assert_close(kn, k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6))
    torch.testing.assert_close(qn * 16**0.5, q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6))


def test_dispatch():
    parents = random_tree(20)
    inputs = gdn_inputs(20)
    o_ref, _ = tree_verify_reference(*inputs, parents)
    for impl in ("auto", "torch", "recurrent", "reference"):
        torch.testing.assert_close(gdn_tree_verify(*inputs, torch.tensor(parents), impl=impl)[0], o_ref,
                                   atol=ATOL, rtol=0)
    with pytest.raises(ValueError):
        gdn_tree_verify(*inputs, parents, impl="nope")


# ---- tree conv ---------------------------------------------------------------------------------------------
def conv_inputs(T: int, C: int = 6, K: int = 4, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(T, C, generator=gen), torch.randn(C, 1, K, generator=gen), torch.randn(C, generator=gen),
            torch.randn(C, K - 1, generator=gen))


@FAST
@given(parents=parent_lists(max_size=40), seed=st.integers(0, 2**16), K=st.sampled_from([2, 3, 4]),
       bias=st.booleans())
def test_tree_conv_matches_per_path_conv(parents, seed, K, bias):
    x, w, b, state = conv_inputs(len(parents), K=K, seed=seed)
    b = b if bias else None
    torch.testing.assert_close(tree_conv1d(x, w, b, state, parents), tree_conv1d_reference(x, w, b, state, parents))


def test_tree_conv_on_a_chain_is_the_causal_conv():
    x, w, b, state = conv_inputs(7)
    seq = torch.cat([state, x.t()], 1)[None]  # the committed inputs then the new ones, as in a cached forward
    expected = F.silu(F.conv1d(seq, w, b, groups=6)[0].t())
    torch.testing.assert_close(tree_conv1d(x, w, b, state, list(range(-1, 6))), expected)


@FAST
@given(parents=parent_lists(max_size=30), seed=st.integers(0, 2**16), data=st.data())
def test_conv_commit_is_last_inputs_on_path(parents, seed, data):
    x, _, _, state = conv_inputs(len(parents), seed=seed)
    node = data.draw(st.integers(0, len(parents) - 1))
    path = path_to(parents, node)
    expected = torch.cat([state, x[path].t()], 1)[:, -3:]
    torch.testing.assert_close(commit_conv_state(x, state, parents, node), expected)
    if len(path) == 1:  # root only: two committed columns then the root's input
        torch.testing.assert_close(expected, torch.cat([state[:, 1:], x[:1].t()], 1))


# ---- Triton kernel (interpreted on CPU) --------------------------------------------------------------------
TRITON_CASES = [(1, 16, 16, 16, None), (9, 16, 16, 16, None), (40, 16, 16, 16, None), (70, 64, 16, 16, None),
                (37, 16, 24, 40, 16)]  # (T, block, dk, dv, block_v): one and several row blocks, split dv


def run_triton_cases(device: str = "cpu") -> None:
    """The kernel against the per-branch reference: interpreted on the CPU, compiled on "cuda"."""
    for T, block, dk, dv, block_v in TRITON_CASES:
        parents = random_tree(T, seed=T)
        inputs = tuple(t.to(device) for t in gdn_inputs(T, dk=dk, dv=dv, seed=T, g_min=-20.0 if T == 40 else -3.0))
        o_ref, s_ref = tree_verify_reference(*inputs, parents)
        o, stash = triton_tree.tree_solve_triton(*inputs, parents, block=block, block_v=block_v)
        torch.testing.assert_close(o, o_ref, atol=ATOL, rtol=0)
        torch.testing.assert_close(stash.U, s_ref.U, atol=ATOL, rtol=0)
        torch.testing.assert_close(commit_state(stash, inputs[-1], T - 1), replay(inputs, path_to(parents, T - 1)),
                                   atol=ATOL, rtol=0)


@pytest.mark.skipif(not triton_tree.HAS_TRITON, reason="triton is not installed")
def test_triton_matches_reference():
    # interpreted only if triton itself (its tl.sum included) was imported with TRITON_INTERPRET=1
    if all(type(f).__name__ == "InterpretedFunction" for f in (triton_tree._tree_solve_kernel, triton_tree.tl.sum)):
        run_triton_cases()
        return
    # triton was imported before TRITON_INTERPRET=1 could be set (transformers imports it): use a fresh process
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1] / "src"), str(Path(__file__).parent)])}
    done = subprocess.run([sys.executable, "-c", "import test_gdn; test_gdn.run_triton_cases()"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-4000:]
