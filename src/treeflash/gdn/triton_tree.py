"""(c) as a Triton kernel: tree K K^T with the masked decay, the triangular solve and the output, fused.

One program per (head, block of dv columns): the solve is independent per column of U, so splitting dv only
repeats the cheap T x T part. Rows are handled in blocks of BT nodes in topological order; block b first
subtracts the earlier blocks' contributions (A_bc U_c, reloading U_c from memory), then solves its own
unit-lower-triangular block by forward substitution, row by row. All math is fp32 with IEEE dots (no TF32).

Triton is optional: without it `HAS_TRITON` is False and `tree_solve_triton` raises. To run the kernel on CPU,
set TRITON_INTERPRET=1 before triton is first imported.
"""

from __future__ import annotations

import torch

from .state import GDNStash
from .tree_utils import Parents, ancestor_mask, as_parent_list, path_gates

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # the torch implementations still work
    triton, tl, HAS_TRITON = None, None, False


if HAS_TRITON:

    @triton.jit
    def _tree_solve_kernel(q_ptr, k_ptr, v_ptr, G_ptr, beta_ptr, S0_ptr, M_ptr, o_ptr, U_ptr, T,
                           H: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                           BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
        h, iv = tl.program_id(0), tl.program_id(1)
        ok = tl.arange(0, BK)
        ov = iv * BV + tl.arange(0, BV)
        mk, mv = ok < DK, ov < DV
        t_loc = tl.arange(0, BT)
        S0 = tl.load(S0_ptr + h * DK * DV + ok[:, None] * DV + ov[None, :], mask=mk[:, None] & mv[None, :],
                     other=0.0)  # [BK, BV]

        for s in range(0, T, BT):
            rows = s + t_loc
            mr = rows < T
            # padding rows load zeros (beta = 0), so they add nothing and solve to U = 0
            k_b = tl.load(k_ptr + (rows[:, None] * H + h) * DK + ok[None, :], mask=mr[:, None] & mk[None, :],
                          other=0.0)
            q_b = tl.load(q_ptr + (rows[:, None] * H + h) * DK + ok[None, :], mask=mr[:, None] & mk[None, :],
                          other=0.0)
            v_b = tl.load(v_ptr + (rows[:, None] * H + h) * DV + ov[None, :], mask=mr[:, None] & mv[None, :],
                          other=0.0)
            G_b = tl.load(G_ptr + rows * H + h, mask=mr, other=0.0)
            b_b = tl.load(beta_ptr + rows * H + h, mask=mr, other=0.0)
            eG = tl.exp(G_b)
            r = b_b[:, None] * (v_b - eG[:, None] * tl.dot(k_b, S0, input_precision="ieee"))
            o = eG[:, None] * tl.dot(q_b, S0, input_precision="ieee")

            # earlier blocks: every column is before these rows, so the ancestor mask is the strict one
            for c in range(0, s, BT):
                cols = c + t_loc
                k_c = tl.load(k_ptr + (cols[:, None] * H + h) * DK + ok[None, :], mask=mk[None, :], other=0.0)
                U_c = tl.load(U_ptr + (cols[:, None] * H + h) * DV + ov[None, :], mask=mv[None, :], other=0.0)
                G_c = tl.load(G_ptr + cols * H + h)
                anc = tl.load(M_ptr + rows[:, None] * T + cols[None, :], mask=mr[:, None], other=0) != 0
                # mask before exp: off-path pairs become e^-inf = 0, on-path ones are <= 1
                decay = tl.exp(tl.where(anc, G_b[:, None] - G_c[None, :], float("-inf")))
                kk = tl.dot(k_b, tl.trans(k_c), input_precision="ieee")
                r -= tl.dot(b_b[:, None] * kk * decay, U_c, input_precision="ieee")
                qk = tl.dot(q_b, tl.trans(k_c), input_precision="ieee")
                o += tl.dot(qk * decay, U_c, input_precision="ieee")

            # diagonal block: A strictly lower, o's mask includes the node itself
            anc = tl.load(M_ptr + rows[:, None] * T + rows[None, :], mask=mr[:, None] & mr[None, :], other=0) != 0
            diff = G_b[:, None] - G_b[None, :]
            strict = anc & (t_loc[:, None] != t_loc[None, :])
            kk = tl.dot(k_b, tl.trans(k_b), input_precision="ieee")
            A = b_b[:, None] * kk * tl.exp(tl.where(strict, diff, float("-inf")))
            # forward substitution: U_i = r_i - sum_{j<i} A_ij U_j (rows j < i are final at step i)
            U = r
            for i in range(1, BT):
                a_i = tl.sum(tl.where(t_loc[:, None] == i, A, 0.0), axis=0)  # row i of A, [BT]
                upd = tl.sum(a_i[:, None] * U, axis=0)  # [BV]
                U = tl.where(t_loc[:, None] == i, U - upd[None, :], U)
            tl.store(U_ptr + (rows[:, None] * H + h) * DV + ov[None, :], U, mask=mr[:, None] & mv[None, :])

            qk = tl.dot(q_b, tl.trans(k_b), input_precision="ieee")
            o += tl.dot(qk * tl.exp(tl.where(anc, diff, float("-inf"))), U, input_precision="ieee")
            tl.store(o_ptr + (rows[:, None] * H + h) * DV + ov[None, :], o, mask=mr[:, None] & mv[None, :])
            tl.debug_barrier()  # the next blocks reload this block's U


def tree_solve_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                      S0: torch.Tensor, parents: Parents, block: int = 64,
                      block_v: int | None = None) -> tuple[torch.Tensor, GDNStash]:
    """Same interface and result as `tree_verify_solve`: q, k [T, H, dk]; v [T, H, dv]; g, beta [T, H];
    S0 [H, dk, dv]. Returns o [T, H, dv] (fp32) and the stash. `block` (>= 16, a power of 2) is the row block."""
    if not HAS_TRITON:
        raise RuntimeError("triton is not installed; use tree_verify_solve")
    ps = as_parent_list(parents)
    q, k, v, g, beta, S0 = (t.float().contiguous() for t in (q, k, v, g, beta, S0))
    T, H, dk = k.shape
    dv = v.shape[-1]
    mask = ancestor_mask(ps, device=q.device)
    G = path_gates(g, mask).contiguous()
    o, U = torch.empty_like(v), torch.empty_like(v)
    BK = max(16, triton.next_power_of_2(dk))
    BV = block_v or min(64, max(16, triton.next_power_of_2(dv)))
    grid = (H, triton.cdiv(dv, BV))
    _tree_solve_kernel[grid](q, k, v, G, beta, S0, mask.to(torch.int8).contiguous(), o, U, T,
                             H=H, DK=dk, DV=dv, BT=block, BK=BK, BV=BV, num_warps=8)
    return o, GDNStash(k=k, U=U, G=G, parents=ps)
