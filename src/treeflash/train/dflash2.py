"""`treeflash train dflash2`: a DFlash2 drafter (DESIGN section 5a) on the repository's regenerated answers.

Same data, anchors and target pass as `train dflash` (train/dflash.py). Two terms per drafted slot, both weighted by
the position weights exp(-(k-1)/7):

- the backbone: the forward KL from the target's distribution to the drafter's marginal (whole vocabulary: DFlash2
  scores every token, no FR-Spec rows), as `train dflash`;
- the selector, teacher-forced: the slot's K candidates (the marginal's top K) rescored given the true previous
  token, s(c | x_{t-1}), against the target's distribution renormalised over those K, each slot weighted by the
  target's mass m on them: a K-way forward KL.

Where this differs from SpecForge's recipe (DESIGN 5a), and why:
- a K-way KL to the target's distribution instead of a cross-entropy to the gold token, only where the gold token is
  among the K: the training text is the target's own answers (greedy, or T = 1 samples), so the target's
  distribution is at hand and carries more than its argmax; the weight m plays the part of the filter (a slot whose
  mass lies outside the candidates teaches the selector little);
- a constant selector weight (`--selector-weight`, 1) rather than one that ramps up after a warm-up: the ramp
  protects a fresh backbone whose top K is noise, while ours starts from a trained DFlash backbone (`--backbone`);
  from scratch, train the backbone first with `train dflash`.

`--selector-only` trains the selector alone on a frozen backbone, as cheap as the TreeFlash AR layer's training
(the backbone runs without gradients); the convs keep the identity they start as.
"""

from __future__ import annotations

import time

import torch

from ..models.checkpoint import DrafterError
from ..models.dflash import DFlashDrafter
from ..models.dflash2 import DFlash2Drafter, is_dflash2
from .config import DFlash2Run
from .dflash import Sequence, TargetView, drafted_positions
from .losses import POSITION_DECAY, forward_kl, position_weights


def dflash2_loss(model: torch.nn.Module, seq: Sequence, view: TargetView, anchors: torch.Tensor,
                 selector_weight: float = 1.0, backbone: bool = True,
                 decay: float = POSITION_DECAY) -> tuple[torch.Tensor, dict]:
    """Backbone KL (when `backbone`) + selector_weight x the selector's K-way KL, over all anchors' blocks of one
    sequence, and stats (tensors: no host sync). `model` is the DFlash2Drafter, or DistributedDataParallel around
    it; `view` holds the target's log-probabilities over the whole vocabulary."""
    drafter: DFlash2Drafter = getattr(model, "module", model)
    g, S, device = drafter.config.block_size, len(seq.tokens), view.taps.device
    anchors, tokens = anchors.to(device), seq.tokens.to(device)
    predicted = drafted_positions(anchors, g)
    valid = predicted < S
    with torch.set_grad_enabled(backbone and torch.is_grad_enabled()):
        h = model(anchors, tokens, view.taps)[valid]  # [M, H]
        logits = drafter.logits(h).float()  # [M, V]
    rows = predicted[valid] - 1  # the target's distribution of x_t sits at position t - 1
    target_logp = view.logp[rows]
    weights = position_weights(g, decay).to(device)[None].expand_as(predicted)[valid]
    selector = drafter.candidate_selector
    unary, cand = logits.topk(selector.top_k, dim=-1)  # [M, K]
    parents = tokens[rows][:, None]  # teacher forcing: the true previous token (the anchor for slot 1)
    scores = selector.rescore(drafter.norm(h), unary, cand, parents)[:, 0]  # [M, K]
    inside = target_logp.gather(-1, cand)  # the target's log-probabilities of the candidates
    log_mass = inside.logsumexp(-1)
    p_in = (inside - log_mass[:, None]).exp()
    selector_kl = (p_in * (inside - log_mass[:, None] - torch.log_softmax(scores, -1))).sum(-1)
    selector_loss = (weights * log_mass.exp() * selector_kl).sum() / weights.sum()
    loss = selector_weight * selector_loss
    stats = {"selector_loss": selector_loss.detach()}
    if backbone:
        backbone_loss = (weights * forward_kl(target_logp, logits)).sum() / weights.sum()
        loss = loss + backbone_loss
        stats["backbone_loss"] = backbone_loss.detach()
    truth = view.argmax[rows]
    chosen = cand.gather(-1, scores.argmax(-1, keepdim=True))[:, 0]
    depth1 = torch.arange(1, g, device=device)[None].expand_as(predicted)[valid] == 1
    hit, unary_hit = (chosen == truth).float(), (cand[:, 0] == truth).float()
    return loss, {"loss": loss.detach(), **stats, "acc": hit.mean(), "acc_k1": hit[depth1].mean(),
                  "acc_unary": unary_hit.mean(), "in_candidates": (cand == truth[:, None]).any(-1).float().mean(),
                  "tokens": valid.sum()}


def build(job: DFlash2Run, target) -> DFlash2Drafter:
    """The drafter a run starts from: --init (a DFlash2 folder), --backbone (a DFlash folder: its weights, the convs
    the identity, a fresh selector), else fresh at the sizes given."""
    from ..models.dflash_config import DFlashConfig
    from .dflash import mask_token

    own = dict(conv_kernel_size=job.conv_kernel_size, conv_group_size=job.conv_group_size,
               selector_rank=job.selector_rank, selector_top_k=job.selector_top_k)
    if job.init and job.backbone:
        raise DrafterError("--init (a DFlash2 drafter to go on training) and --backbone (a DFlash one to start from) "
                           "exclude each other")
    if job.init:
        if not is_dflash2(job.init):
            raise DrafterError(f"--init {job.init} is not a DFlash2 drafter; start from a DFlash one with --backbone")
        return DFlash2Drafter.from_pretrained(job.init)
    if job.backbone:
        if is_dflash2(job.backbone):
            raise DrafterError(f"--backbone {job.backbone} is a DFlash2 drafter: go on training it with --init")
        return DFlash2Drafter.from_dflash(DFlashDrafter.from_pretrained(job.backbone), **own)
    if job.selector_only:
        raise DrafterError("--selector-only trains the selector on a trained backbone: name it with --backbone or --init")
    config = DFlashConfig.for_target(target.config, num_layers=job.layers, num_taps=job.taps,
                                     block_size=job.block_size, intermediate_size=job.intermediate_size,
                                     mask_token_id=mask_token(job.mask_token, target))
    from ..models.dflash2 import DFlash2Config

    return DFlash2Drafter(DFlash2Config(config, **own))


def run(job: DFlash2Run) -> dict:
    """`treeflash train dflash2` (`job`: its typed config, train/config.py)."""
    from .dflash import launch, sample_anchors, sequences, setup, target_view, training_rows

    rank, world, target = setup(job)
    drafter = build(job, target).attach(target.model).to(target.device)
    trainable = list((drafter.candidate_selector if job.selector_only else drafter).parameters())
    drafter.requires_grad_(False)
    drafter.gradient_checkpointing = job.grad_checkpoint
    for param in trainable:
        param.requires_grad_(True)
    data = sequences(training_rows(job, target), job.max_len, drafter.config.block_size)
    taps = drafter.config.target_layer_ids
    autocast = torch.autocast(target.device.type, dtype=torch.bfloat16, enabled=job.bf16)

    def loss_fn(model, seq, gen):
        started = time.perf_counter()
        view = target_view(target.model, seq.tokens, taps)  # the whole vocabulary: DFlash2 scores every token
        drafting = time.perf_counter()
        with autocast:
            loss, stats = dflash2_loss(model, seq, view, sample_anchors(seq, job.num_anchors, gen),
                                       job.selector_weight, backbone=not job.selector_only)
        return loss, {**stats, "s_target": drafting - started, "s_drafter_forward": time.perf_counter() - drafting}

    return launch(job, world, rank, drafter, trainable, data, loss_fn)
