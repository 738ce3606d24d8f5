"""Training losses: forward KL to the target's distribution with per-position weights."""

from __future__ import annotations

import math

import torch


POSITION_DECAY = 7.0  # DFlash's for γ = 16: drafted position k weighs exp(-(k - 1) / 7)


def position_weights(block_size: int, decay: float = POSITION_DECAY) -> torch.Tensor:
    """w_k = exp(-(k - 1) / decay) for the drafted positions k = 1 .. γ-1 (DFlash: decay 7 for γ = 16)."""
    k = torch.arange(1, block_size, dtype=torch.float32)
    return torch.exp(-(k - 1) / decay)


def forward_kl(target_logp: torch.Tensor, draft_logits: torch.Tensor, topk: int = 0) -> torch.Tensor:
    """KL(p_target || q_draft) per row: [..., V] log-probs and logits -> [...].

    topk > 0: the sparse form over the target's top-k tokens, with the target's remaining mass as one bucket
    (its share of q is the drafter's mass outside those tokens), so the loss is still a proper KL.
    """
    logq = torch.log_softmax(draft_logits.float(), dim=-1)
    if not topk:
        p = target_logp.exp()
        return (p * (target_logp - logq)).sum(-1)
    idx = target_logp.topk(topk, dim=-1).indices
    return candidate_kl(target_logp, idx, logq.gather(-1, idx))


def candidate_kl(target_logp: torch.Tensor, cand: torch.Tensor, draft_logq: torch.Tensor) -> torch.Tensor:
    """KL(p || q) on K + 1 outcomes: K candidate tokens and one bucket for all the others. [...]

    target_logp [..., V] the target's log-distribution; cand [..., K] distinct token ids; draft_logq [..., K] the
    drafter's log-probabilities of the candidates (summing to at most 1). Each side's bucket holds its mass
    outside the candidates, so this is a proper KL, zero exactly when both agree on all K + 1 outcomes.
    """
    logp = target_logp.gather(-1, cand)
    p = logp.exp()
    rest_p = (1 - p.sum(-1)).clamp_min(1e-12)
    rest_q = (1 - draft_logq.exp().sum(-1)).clamp_min(1e-12)
    return (p * (logp - draft_logq)).sum(-1) + rest_p * (rest_p.log() - rest_q.log())


def cosine_lr(step: int, total: int, peak: float, warmup: float = 0.04, floor: float = 0.0) -> float:
    """Linear warm-up over `warmup` of the steps, then cosine decay to `floor`."""
    w = max(1, int(total * warmup))
    if step < w:
        return peak * (step + 1) / w
    t = min(1.0, (step - w) / max(1, total - w))
    return floor + (peak - floor) * 0.5 * (1 + math.cos(math.pi * t))
