"""`treeflash train eagle3`: an EAGLE-3 drafter (models/eagle3.py) on the repository's regenerated answers.

Per sequence: one no-grad target forward gives the three taps and the target's distribution at every position (as
`train dflash`). Training-time test (EAGLE-3): step 0 runs the layer over every position t with the token x_{t+1}
and the fused taps of t, causally, and learns the target's distribution of x_{t+2}; step j feeds each position its
own step j - 1 output with x_{t+1+j} and learns x_{t+2+j}, seeing the step-0 keys up to t and its own keys of the
earlier steps (what a depth-j node sees at inference: the context and its ancestors). Step j's loss is weighted
0.8^j; each row's is the forward KL to the target's distribution restricted to the draft vocabulary, weighted by
the target's mass there (as `train dflash`'s, train/dflash.py). Only rows that predict answer tokens count.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from ..models.checkpoint import DrafterError
from ..models.eagle3 import Eagle3Config, Eagle3Drafter, is_eagle3
from .config import Eagle3Run
from .dflash import DEFAULT_DRAFT_VOCAB, Sequence, TargetView, launch, sequences, setup, target_view, training_rows
from .losses import forward_kl

STEP_DECAY = 0.8  # EAGLE-3's weight of step j: 0.8^j


def ttt_attention(q: torch.Tensor, ctx_k: torch.Tensor, ctx_v: torch.Tensor, own_k: list[torch.Tensor],
                  own_v: list[torch.Tensor]) -> torch.Tensor:
    """Step j's attention: q [n, heads, d] of positions 0..n-1 over the step-0 keys ctx_k, ctx_v [T, kv_heads, d] up
    to their own position, and over their own keys of steps 1..j (own_k[i] [>= n, kv_heads, d], the same position)
    -> [n, heads, d], one softmax over both."""
    n, heads, d = q.shape
    groups = heads // ctx_k.shape[1]
    k0, v0 = (x.repeat_interleave(groups, dim=1).to(q.dtype) for x in (ctx_k, ctx_v))
    scores = torch.einsum("nhd,thd->hnt", q, k0)
    causal = torch.arange(len(k0), device=q.device)[None, :] <= torch.arange(n, device=q.device)[:, None]
    scores = scores.masked_fill(~causal, float("-inf"))
    own = [(k[:n].repeat_interleave(groups, dim=1).to(q.dtype), v[:n].repeat_interleave(groups, dim=1).to(q.dtype))
           for k, v in zip(own_k, own_v)]
    diag = torch.stack([(q * k).sum(-1).T for k, _ in own], dim=-1) if own else scores.new_zeros(heads, n, 0)
    p = torch.softmax(torch.cat([scores, diag], dim=-1).float() * d ** -0.5, dim=-1).to(q.dtype)
    out = torch.einsum("hnt,thd->nhd", p[..., :len(k0)], v0)
    for i, (_, v) in enumerate(own):
        out = out + p[..., len(k0) + i].T[..., None] * v
    return out


def ttt_states(drafter: Eagle3Drafter, tokens: torch.Tensor, taps: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """The layer's outputs at every training-time-test step: step j's [S - 1 - j, H] at positions t = 0.. (it
    predicts x_{t+2+j}), for the sequence `tokens` [S] whose target taps are `taps` [S, 3, H]."""
    layer, T = drafter.midlayer, len(tokens) - 1
    positions = torch.arange(T, device=tokens.device)
    state, ctx_k, ctx_v, own_k, own_v, out = drafter.fuse(taps[:T]), None, None, [], [], []
    for j in range(min(steps, T)):
        n = T - j  # positions whose step-j token x_{t+1+j} exists
        q, k, v = layer.qkv(drafter.embed(tokens[1 + j:1 + j + n]), state[:n], positions[:n] + j)
        if j == 0:
            ctx_k, ctx_v = k, v
        else:
            own_k.append(k)
            own_v.append(v)
        state = layer.finish(state[:n], ttt_attention(q, ctx_k, ctx_v, own_k, own_v))
        out.append(state)
    return out


def eagle3_loss(model: torch.nn.Module, seq: Sequence, view: TargetView, steps: int = 7) -> tuple[torch.Tensor, dict]:
    """The training-time-test loss of one sequence over `steps` steps, and stats (tensors: no host sync). `model`
    is the Eagle3Drafter, or DistributedDataParallel around it (its parameters are what the loss reaches)."""
    drafter: Eagle3Drafter = getattr(model, "module", model)
    tokens = seq.tokens.to(view.taps.device)
    total = weights = torch.zeros((), device=tokens.device)
    stats = {}
    for j, states in enumerate(ttt_states(drafter, tokens, view.taps, steps)):
        rows = torch.arange(len(states), device=tokens.device) + 1 + j  # x_{t+2+j}'s distribution sits at t+1+j
        answer = rows + 1 >= seq.prompt_len  # rows that predict an answer token
        if not answer.any():
            continue
        scores = drafter.scores(states[answer]).float()
        target_logp = view.logp[rows[answer]]
        inside = target_logp.logsumexp(-1)  # log of the target's mass on the draft vocabulary
        kl = forward_kl(target_logp - inside[:, None], scores)
        total = total + STEP_DECAY ** j * (inside.exp() * kl).mean()
        weights = weights + STEP_DECAY ** j
        if j == 0:
            hit = (drafter.vocab_ids[scores.argmax(-1)] == view.argmax[rows[answer]]).float().mean()
            # acc: the first step's top-1 agreement with the target (the depth-1 figure of the block drafters' logs)
            stats = {"kl": kl.detach().mean(), "acc": hit, "acc_k1": hit, "outside": 1 - inside.exp().mean(),
                     "tokens": answer.sum()}
    loss = total / weights.clamp(min=1e-9)
    return loss, {"loss": loss.detach(), **stats}


def build(job: Eagle3Run, target, rows: list[dict]) -> tuple[Eagle3Drafter, dict | None]:
    """The drafter a run starts from (--init, or fresh: its draft vocabulary the --draft-vocab tokens most frequent
    in the answers, its LM head their rows of the target's), and the token ranking to save beside it."""
    from .data import token_ranking

    if job.init:
        if not is_eagle3(job.init):
            raise DrafterError(f"--init {job.init} is not an EAGLE-3 drafter")
        return Eagle3Drafter.from_pretrained(job.init).attach(target.model).to(target.device), None
    ranking, stats = token_ranking([r["response_ids"] for r in rows])
    vocab = target.config.vocab_size
    size = min(DEFAULT_DRAFT_VOCAB, len(ranking)) if job.draft_vocab is None else (job.draft_vocab or vocab)
    if size > len(ranking) and size != vocab:
        raise DrafterError(f"--draft-vocab {size}: the training answers hold only {len(ranking)} distinct tokens")
    ids = torch.arange(vocab) if size == vocab else torch.tensor(ranking[:size])
    drafter = Eagle3Drafter(Eagle3Config.for_target(target.config, size)).to(target.device)
    drafter.use_vocab(ids, target.model.get_output_embeddings().weight)
    return drafter.attach(target.model), {"data": job.data, **stats, "ranking": ranking}


def run(job: Eagle3Run) -> dict:
    """`treeflash train eagle3` (`job`: its typed config, train/config.py)."""
    rank, world, target = setup(job)
    rows = training_rows(job, target)
    drafter, ranking = build(job, target, rows)
    trainable = list(drafter.parameters())
    data = sequences(rows, job.max_len, 2)
    taps = drafter.config.target_layer_ids
    autocast = torch.autocast(target.device.type, dtype=torch.bfloat16, enabled=job.bf16)

    def loss_fn(model, seq, gen):
        started = time.perf_counter()
        view = target_view(target.model, seq.tokens, taps, drafter.vocab_ids)
        drafting = time.perf_counter()
        with autocast:
            loss, stats = eagle3_loss(model, seq, view, job.ttt_steps)
        return loss, {**stats, "s_target": drafting - started, "s_drafter_forward": time.perf_counter() - drafting}

    def save(folder: Path) -> None:
        drafter.save_pretrained(folder)
        if ranking is not None:
            (Path(folder) / "token_ranking.json").write_text(json.dumps(ranking) + "\n")

    return launch(job, world, rank, drafter, trainable, data, loss_fn, save_model=save)
