"""`treeflash train weaver`: the Weaver adapter on a frozen DFlash backbone (DESIGN section 5).

Same data, anchors and target pass as `train dflash` (train/dflash.py). Teacher forcing: the branch of each
anchor's block is the true continuation, so at depth d the Weaver's parent token is the true token x_{a+d-1}.

Loss: a forward KL on K + 1 outcomes, the depth's K candidates and one bucket for the rest of the vocabulary.
The Weaver only redistributes the mass the (frozen) DFlash marginal puts on the candidates:

    q(i) = m_in * softmax(marginal logits + residual)_i  for the K candidates,   q(bucket) = 1 - m_in,

with m_in the marginal's mass on the candidates; the target's bucket is its mass outside them. This is a proper
KL (`losses.candidate_kl`), zero only if the Weaver matches the target on every candidate and the marginal's
bucket matches the target's; the bucket term is constant for the Weaver, so its gradient is that of the
cross-entropy of the target's in-candidate mass. Depth d is weighted by `position_weights` (exp(-(d-1)/7)).
"""

from __future__ import annotations

import torch

from ..models.checkpoint import DrafterError
from ..models.dflash import DFlashDrafter
from ..models.weaver import Weaver
from .config import WeaverRun
from .dflash import Sequence, TargetView, drafted_positions, learned_positions
from .losses import POSITION_DECAY, candidate_kl, position_weights


def weaver_logits(model: torch.nn.Module, drafter: DFlashDrafter, tokens: torch.Tensor, taps: torch.Tensor,
                  anchors: torch.Tensor, lengths: torch.Tensor | None = None):
    """Teacher-forced Weaver logits for N anchors' blocks of one sequence (tokens [S], taps [S, n_taps, H]).

    Returns predicted [N, γ-1] (positions of the drafted tokens; some past the end), cand [N, γ-1, K] (the top-K
    of each depth's DFlash marginal), logits [N, γ-1, K] (marginal log-probs + residual: their softmax is the
    Weaver's distribution) and log_inside [N, γ-1] (log of the marginal's mass on the candidates). With `lengths`
    [N], block n is its first lengths[n] positions (a backbone trained for short blocks; `train.dflash.block_lengths`).
    `model` is the Weaver, or DistributedDataParallel around it."""
    weaver: Weaver = getattr(model, "module", model)
    S = len(tokens)
    predicted = drafted_positions(anchors, drafter.config.block_size)
    with torch.no_grad():  # the backbone is frozen
        h = drafter(anchors, tokens, taps, lengths=lengths)  # [N, γ-1, H]
        marginal = torch.log_softmax(drafter.logits(h).float(), dim=-1)
        cand_logp, cand = marginal.topk(weaver.config.top_k, dim=-1)
        ctx = drafter.fuse(taps[(anchors - 1).clamp(min=0)])  # the last committed position before each root
    parents = tokens[(predicted - 1).clamp(max=S - 1)]  # depth 1's parent is the anchor (root) token
    out = model(h, ctx, parents)  # [N, γ-1, H]
    return predicted, cand, cand_logp + weaver.residual(out, cand), cand_logp.logsumexp(-1)


def weaver_loss(model: torch.nn.Module, drafter: DFlashDrafter, seq: Sequence, view: TargetView,
                anchors: torch.Tensor, decay: float = POSITION_DECAY,
                lengths: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
    """Weighted candidate-plus-bucket forward KL over all anchors' blocks of one sequence (only their first
    lengths[n] positions, where given), and stats."""
    device = view.taps.device
    tokens, anchors = seq.tokens.to(device), anchors.to(device)
    lengths = None if lengths is None else lengths.to(device)
    predicted, cand, logits, log_inside = weaver_logits(model, drafter, tokens, view.taps, anchors, lengths)
    valid = learned_positions(predicted, len(tokens), lengths)
    cand, logits = cand[valid], logits[valid].float()
    logq = torch.log_softmax(logits, dim=-1) + log_inside[valid, None]
    target_logp = view.logp[predicted[valid] - 1]  # the target's distribution of x_t sits at position t - 1
    kl = candidate_kl(target_logp, cand, logq)
    weights = position_weights(drafter.config.block_size, decay).to(device)[None].expand_as(predicted)[valid]
    loss = (weights * kl).sum() / weights.sum()
    truth = target_logp.argmax(-1)
    hit = (cand.gather(-1, logits.argmax(-1, keepdim=True))[:, 0] == truth).float()
    hit_dflash = (cand[:, 0] == truth).float()
    # depth 1 apart: the root's call, where the Weaver knows the root token but no drafted parent
    depth1 = (torch.arange(predicted.shape[1], device=device) == 0).expand_as(predicted)[valid]
    return loss, {"loss": loss.item(), "kl": kl.mean().item(), "acc": hit.mean().item(),
                  "acc_dflash": hit_dflash.mean().item(), "acc_depth1": hit[depth1].mean().item(),
                  "acc_dflash_depth1": hit_dflash[depth1].mean().item(),
                  "in_candidates": (cand == truth[:, None]).any(-1).float().mean().item(),
                  "tokens": int(valid.sum())}


def run(job: WeaverRun) -> dict:
    """`treeflash train weaver` (`job`: its typed config, train/config.py)."""
    from ..models.checkpoint import weights_digest
    from ..models.weaver import WeaverConfig
    from .dflash import (block_lengths, launch, sample_anchors, sequences, setup, short_block_share, target_view,
                         training_rows)

    rank, world, target = setup(job)
    drafter = DFlashDrafter.from_pretrained(job.backbone).attach(target.model).to(target.device).eval()
    drafter.requires_grad_(False)
    if job.init:  # go on training a Weaver (its own sizes, not --width etc.), possibly moved to a new backbone
        weaver = Weaver.from_pretrained(job.init).attach(drafter).to(target.device).train()
    else:
        config = WeaverConfig.for_drafter(drafter.config, job.width, job.weaver_layers, job.heads, job.top_k)
        weaver = Weaver(config).attach(drafter).to(target.device)
    weaver.config.backbone_sha256 = weights_digest(job.backbone)  # saved with it, checked where it is loaded
    data = sequences(training_rows(job, target), job.max_len, drafter.config.block_size)
    taps = drafter.config.target_layer_ids
    autocast = torch.autocast(target.device.type, dtype=torch.bfloat16, enabled=job.bf16)
    # a backbone trained for short blocks drafts from them: the Weaver learns on the states they give
    short_share = short_block_share(job.short_blocks, drafter.config.short_blocks)
    if short_share and not drafter.config.short_blocks:
        raise DrafterError("--short-blocks: the backbone was not trained for short blocks (`train dflash "
                           "--short-blocks`)")

    def loss_fn(model, seq, gen):
        view = target_view(target.model, seq.tokens, taps)
        anchors = sample_anchors(seq, job.num_anchors, gen)
        lengths = block_lengths(len(anchors), drafter.config.block_size, short_share, gen)
        with autocast:
            return weaver_loss(model, drafter, seq, view, anchors, lengths=lengths)

    return launch(job, world, rank, weaver, list(weaver.parameters()), data, loss_fn, model_dir="weaver")
