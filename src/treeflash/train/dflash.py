"""`treeflash train dflash`: the DFlash block drafter on self-distilled data (DESIGN section 2).

Per sequence: one no-grad target forward gives the tapped hidden states (context features) and the target's
distribution at every position. Random anchors a in the answer each make a block [x_a, mask x (γ-1)] at
positions a..a+γ-1 that sees the context strictly before a and its own block, never another block; position k
learns the target's distribution of x_{a+k} by forward KL, weighted by exp(-(k-1)/7).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..models.checkpoint import DrafterError
from ..models.dflash import DFlashDrafter
from ..models.dflash_io import RANKING_FILE
from .config import DFlashRun, TrainRun, TreeFlashRun
from .losses import POSITION_DECAY, forward_kl, position_weights

DEFAULT_DRAFT_VOCAB = 4096  # FR-Spec rows a fresh drafter is trained on and scores at inference


@dataclass
class Sequence:
    tokens: torch.Tensor  # [S] prompt + answer
    prompt_len: int


@dataclass
class TargetView:
    taps: torch.Tensor  # [S, n_taps, H]
    logp: torch.Tensor  # [S, V'] fp32: the target's log-probabilities of the next token, on the `vocab` columns
    vocab: torch.Tensor | None  # [V'] the token ids of those columns (the drafter's draft vocabulary); None: all
    argmax: torch.Tensor  # [S] the target's most likely next token over the whole vocabulary


def sequences(rows: list[dict], max_len: int, block_size: int) -> list[Sequence]:
    """Regenerated rows as training sequences, cut to max_len; rows without room for one block are dropped."""
    out = []
    for r in rows:
        ids = (r["prompt_ids"] + r["response_ids"])[:max_len]
        if len(ids) - len(r["prompt_ids"]) >= 2:
            out.append(Sequence(torch.tensor(ids), len(r["prompt_ids"])))
    return out


@torch.no_grad()
def target_view(target_model, tokens: torch.Tensor, taps: list[int], vocab: torch.Tensor | None = None) -> TargetView:
    out = target_model(tokens[None].to(target_model.device), output_hidden_states=True)
    feats = torch.stack([out.hidden_states[i + 1][0] for i in taps], dim=1)
    logits = out.logits[0].float()
    # normalised over the whole vocabulary, then only the drafter's columns kept: the rows the loss gathers stay small
    logp = (logits if vocab is None else logits[:, vocab.to(logits.device)]) - logits.logsumexp(-1, keepdim=True)
    return TargetView(feats, logp, vocab, logits.argmax(-1))


def sample_anchors(seq: Sequence, n: int, gen: torch.Generator) -> torch.Tensor:
    """Up to n distinct anchors in the answer: positions prompt_len .. S-2 (each predicts at least one token)."""
    first, last = seq.prompt_len, len(seq.tokens) - 2
    count = last - first + 1
    pick = torch.randperm(count, generator=gen)[: min(n, count)]
    return (first + pick).sort().values


def block_lengths(n: int, block_size: int, share: float, gen: torch.Generator) -> torch.Tensor | None:
    """[n] block lengths for `--short-blocks`: a `share` of the blocks cut to a length drawn uniformly from
    2..γ-1 (a tree 1..γ-2 deep reads that many), the others whole; None when share is 0 (every block whole)."""
    if share <= 0:
        return None
    cut = torch.rand(n, generator=gen) < share
    return torch.where(cut, torch.randint(2, block_size, (n,), generator=gen), block_size)


def short_block_share(requested: float | None, trained: bool) -> float:
    """--short-blocks: the share of blocks to cut (`block_lengths`); unset, half for a drafter trained for short
    blocks (it goes on so), none for others."""
    share = requested if requested is not None else 0.5 * trained
    if not 0 <= share < 1:
        raise DrafterError(f"--short-blocks {share}: a share of the blocks, at least 0 and below 1")
    return share


def drafted_positions(anchors: torch.Tensor, block_size: int) -> torch.Tensor:
    """[N, γ-1]: the positions whose tokens the blocks anchored at `anchors` draft (some may lie past the end)."""
    return anchors[:, None] + torch.arange(1, block_size, device=anchors.device)


def learned_positions(predicted: torch.Tensor, length: int, lengths: torch.Tensor | None) -> torch.Tensor:
    """[N, γ-1] bool: which drafted positions (`drafted_positions`) learn: those inside the sequence of `length`
    tokens, and inside their block where blocks are cut to `lengths` [N] (`block_lengths`)."""
    valid = predicted < length
    if lengths is not None:
        valid &= torch.arange(1, predicted.shape[1] + 1, device=predicted.device) < lengths[:, None]
    return valid


def dflash_loss(model: torch.nn.Module, seq: Sequence, view: TargetView, anchors: torch.Tensor,
                kl_topk: int = 0, decay: float = POSITION_DECAY,
                lengths: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
    """Weighted forward KL over all anchors' blocks of one sequence, and stats (tensors: no host sync). With
    `lengths` [N] (`block_lengths`), block n is its first lengths[n] positions, and only those learn.

    Over the draft vocabulary V' (`view.vocab`, the FR-Spec rows the drafter scores at inference): the drafter can
    only ever propose those tokens, so its target there is the target's distribution restricted to V' and
    renormalised, p' = p / m with m = p(V'). Each row's KL(p' || q) is weighted by m: a row whose next token is
    mostly outside V' teaches little. That is the cross-entropy -sum_{V'} p log q up to a constant; the mass
    outside, 1 - m, is no loss term (nothing the drafter does changes it) and is reported as `outside`. With the
    whole vocabulary (view.vocab None) m = 1: the plain forward KL.

    `model` is the DFlashDrafter, or DistributedDataParallel around it (its forward must be the call)."""
    drafter: DFlashDrafter = getattr(model, "module", model)
    g, S, device = drafter.config.block_size, len(seq.tokens), view.taps.device
    anchors, tokens = anchors.to(device), seq.tokens.to(device)
    predicted = drafted_positions(anchors, g)
    prev = None
    if drafter.ar_layer is not None:  # TreeFlash: teacher forcing, the true previous token(s)
        back = torch.arange(drafter.ar_layer.prev_tokens, 0, -1, device=device)
        prev = tokens[(predicted[:, :, None] - back).clamp(max=S - 1)]
    if lengths is not None:
        lengths = lengths.to(device)
    h = model(anchors, tokens, view.taps, prev, lengths)  # [N, γ-1, H]
    valid = learned_positions(predicted, S, lengths)
    scores = drafter.scores(h[valid]).float()  # over the draft vocabulary, when the drafter has one
    rows = predicted[valid] - 1  # the target's distribution of x_t sits at position t - 1
    target_logp = view.logp[rows]
    inside = target_logp.logsumexp(-1)  # log m
    weights = position_weights(g, decay).to(device)[None].expand_as(predicted)[valid]
    kl = forward_kl(target_logp - inside[:, None], scores, kl_topk)
    mass = inside.exp()
    loss = (weights * mass * kl).sum() / weights.sum()
    best = scores.argmax(-1)
    hit = ((best if view.vocab is None else view.vocab.to(device)[best]) == view.argmax[rows]).float()
    depth1 = torch.arange(1, g, device=device)[None].expand_as(predicted)[valid] == 1
    return loss, {"loss": loss.detach(), "kl": kl.detach().mean(), "outside": 1 - mass.mean(),
                  "acc": hit.mean(), "acc_k1": hit[depth1].mean(), "tokens": valid.sum()}


def run(job: DFlashRun | TreeFlashRun) -> dict:
    """`treeflash train dflash` and `treeflash train treeflash` (`job`: its typed config, train/config.py).

    A DFlash drafter starts fresh at the sizes given, or from a trained one (--init) with a new optimiser and
    learning-rate schedule: a second stage on more data, or a published drafter fine-tuned on one's own; with
    --add-layers, grown by that many layers that start as the identity (`DFlashDrafter.add_layers`).

    TreeFlash starts from a trained DFlash backbone (--backbone), adds a zero-initialised AR layer and trains it,
    alone (--freeze-backbone) or with the backbone, on the same objective with teacher forcing. A TreeFlash
    drafter as --backbone continues: its AR layer is trained further (the --ar-* options are then its own). With
    --init, a DFlash backbone gets the AR layer of that TreeFlash drafter (its own settings) as a starting point."""
    from ..models.dflash_config import DFlashConfig

    rank, world, target = setup(job)
    if job.kind == "treeflash":
        drafter = DFlashDrafter.from_pretrained(job.backbone).attach(target.model).to(target.device)
        # a TreeFlash drafter as --backbone goes on training its AR layer; an adapter is saved against its backbone
        saved_against = drafter.backbone_folder
        if drafter.ar_layer is None:
            if job.init:  # the AR layer of another TreeFlash drafter (e.g. of an older backbone) to start from
                source = DFlashDrafter.from_pretrained(job.init)
                if source.ar_layer is None:
                    raise DrafterError(f"--init {job.init} is not a TreeFlash drafter (it has no AR layer)")
                drafter.add_ar_layer(**source.config.ar_layer)
                drafter.ar_layer.load_state_dict(source.ar_layer.state_dict())
            else:
                drafter.add_ar_layer(job.ar_kind, job.prev_tokens, job.ar_intermediate_size)
            saved_against = job.backbone
        elif job.init:
            raise DrafterError(f"--backbone {job.backbone} has an AR layer already: --init needs a DFlash backbone")
        trainable = list((drafter.ar_layer if job.freeze_backbone else drafter).parameters())
    elif job.init:  # go on training a DFlash drafter (its own sizes: --layers etc. do not apply)
        drafter = DFlashDrafter.from_pretrained(job.init).attach(target.model)
        if drafter.ar_layer is not None:
            raise DrafterError(f"{job.init} is a TreeFlash drafter: go on training it with `treeflash train treeflash "
                               f"--backbone {job.init}`")
        drafter = drafter.add_layers(job.add_layers).to(target.device)
        trainable = list(drafter.parameters())
    else:
        if job.add_layers:
            raise DrafterError("--add-layers grows a trained drafter: it needs --init (a fresh one takes --layers)")
        config = DFlashConfig.for_target(target.config, num_layers=job.layers, num_taps=job.taps,
                                         block_size=job.block_size, intermediate_size=job.intermediate_size,
                                         mask_token_id=mask_token(job.mask_token, target))
        drafter = DFlashDrafter(config).attach(target.model).to(target.device)
        if job.init_layers == "target":
            init_from_target(drafter, target.model)
        trainable = list(drafter.parameters())
    drafter.requires_grad_(False)
    drafter.gradient_checkpointing = job.grad_checkpoint
    for param in trainable:
        param.requires_grad_(True)
    config = drafter.config
    short_share = short_block_share(job.short_blocks, config.short_blocks)
    if short_share and job.kind == "treeflash" and job.freeze_backbone and not config.short_blocks:
        raise DrafterError("--short-blocks with --freeze-backbone: the backbone was not trained for short blocks")
    config.short_blocks = config.short_blocks or short_share > 0
    rows = training_rows(job, target)
    ranking = training_vocab(job, drafter, rows)
    vocab = drafter.draft_vocab
    data = sequences(rows, job.max_len, config.block_size)
    taps = config.target_layer_ids
    autocast = torch.autocast(target.device.type, dtype=torch.bfloat16, enabled=job.bf16)

    def loss_fn(model, seq, gen):
        started = time.perf_counter()
        view = target_view(target.model, seq.tokens, taps, vocab)
        drafting = time.perf_counter()
        anchors = sample_anchors(seq, job.num_anchors, gen)
        lengths = block_lengths(len(anchors), config.block_size, short_share, gen)
        with autocast:
            loss, stats = dflash_loss(model, seq, view, anchors, job.kl_topk, job.loss_decay, lengths)
        return loss, {**stats, "s_target": drafting - started, "s_drafter_forward": time.perf_counter() - drafting}

    adapter = job.kind == "treeflash" and job.freeze_backbone and saved_against is not None

    def save(folder: Path) -> None:
        if adapter:  # the AR layer only: its draft vocabulary is its backbone's
            return drafter.save_pretrained(folder, backbone=saved_against)
        drafter.save_pretrained(folder)
        if ranking is not None:
            (Path(folder) / RANKING_FILE).write_text(json.dumps(ranking) + "\n")

    return launch(job, world, rank, drafter, trainable, data, loss_fn, save_model=save)


def init_from_target(drafter: DFlashDrafter, target_model) -> list[int]:
    """Start the draft layers as copies of the target's last ones, and the context projection as the choice of the
    deepest tap: a drafter's states end in the target's final norm and LM head, which the target's top layers write
    for, and the deepest tap is the state those layers read in the target. Returns the target layers copied.
    (Qwen3-style q_norm / k_norm, which Llama layers lack, start as ones.)"""
    c = drafter.config
    layers = target_model.model.layers
    chosen = list(range(len(layers) - c.num_hidden_layers, len(layers)))
    with torch.no_grad():
        for mine, theirs in zip(drafter.layers, (layers[i] for i in chosen)):
            state = {k: v for k, v in theirs.state_dict().items() if not k.endswith("rotary_emb.inv_freq")}
            wrong = [k for k, v in state.items() if k not in mine.state_dict() or mine.state_dict()[k].shape != v.shape]
            if wrong:
                raise DrafterError(f"--init-layers target: the target's layers do not fit the draft layers ({wrong[:3]})")
            missing = set(mine.state_dict()) - set(state)
            if not all(k.endswith(("q_norm.weight", "k_norm.weight")) for k in missing):
                raise DrafterError(f"--init-layers target: the target's layers lack {sorted(missing)[:3]}")
            mine.load_state_dict(state, strict=False)
        h = c.hidden_size
        drafter.fc.weight.zero_()
        drafter.fc.weight[:, -h:] = torch.eye(h)  # taps are flattened in target_layer_ids order: the deepest last
    return chosen


def training_vocab(job: DFlashRun | TreeFlashRun, drafter: DFlashDrafter, rows: list[dict]) -> dict | None:
    """Set the draft vocabulary the loss is taken over on the drafter, and return the token ranking to save with it
    (token_ranking.json; None: nothing to write). --draft-vocab N: the N tokens most frequent in the training
    answers (0: the whole vocabulary); unset, a trained drafter (--init, --backbone) keeps the vocabulary it has
    (its ranking and draft_vocab_size), a fresh one takes 4,096 (the size the shipped drafters score), or every
    token the answers hold where they hold fewer."""
    from ..models.dflash_io import RANKING_FILE, draft_vocab
    from .data import token_ranking

    trained = job.backbone if job.kind == "treeflash" else job.init
    if trained is not None and job.draft_vocab is None:
        drafter.use_draft_vocab(draft_vocab(drafter, trained))
        source = Path(trained) / RANKING_FILE
        return json.loads(source.read_text()) if source.is_file() else None
    ranking, stats = token_ranking([r["response_ids"] for r in rows])
    size = min(DEFAULT_DRAFT_VOCAB, len(ranking)) if job.draft_vocab is None else job.draft_vocab
    if len(ranking) < size < drafter.config.vocab_size:
        raise DrafterError(f"--draft-vocab {size}: the training answers hold only {len(ranking)} distinct tokens")
    whole = not 0 < size < drafter.config.vocab_size
    drafter.config.draft_vocab_size = None if whole else size
    drafter.use_draft_vocab(None if whole else torch.tensor(ranking[:size]))
    return {"data": job.data, **stats, "ranking": ranking}


def training_rows(job: TrainRun, target) -> list[dict]:
    """The rows of --data (answer stores) from --sources, repeated as --repeat says, their prompts read back from
    --data-dir and encoded by the target."""
    from ..eval.datasets import default_data_dir
    from .store import load_answers

    return load_answers(job.data, target.encode_prompt, Path(job.data_dir) if job.data_dir else default_data_dir(),
                        job.sources, job.repeat)


def mask_token(choice: str | None, target) -> int:
    """--mask-token: an id or a token's text of the target's vocabulary; None: choose_mask_token."""
    from ..models.dflash_config import choose_mask_token

    if choice is None:
        return choose_mask_token(target.tokenizer)
    vocab = target.config.vocab_size
    if choice.isdigit():
        token = int(choice)
    else:
        token = target.tokenizer.convert_tokens_to_ids(choice) if target.tokenizer is not None else None
        if token is None or token == target.tokenizer.unk_token_id:
            raise DrafterError(f"--mask-token {choice!r} is not a token of the target's vocabulary")
    if not 0 <= token < vocab:
        raise DrafterError(f"--mask-token {choice} is outside the target's vocabulary (0..{vocab - 1})")
    return token


def setup(job: TrainRun):
    """(rank, world size, the frozen target) for a training run; one CPU share per process under torchrun."""
    import os

    from ..runtime import Target, native_bf16
    from .processes import init_distributed

    rank, world = init_distributed()  # (each process on its own GPU)
    if job.threads:
        torch.set_num_threads(job.threads)
    if not torch.cuda.is_available() and world > 1 and not job.threads:
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    # the dense weights: training was measured on them (a GGUF target's int4 kernels have no gradients either)
    target = Target.load(job.target, dtype=job.target_dtype, device=job.device, quantize="none")
    if job.bf16 is None:  # emulated bf16 (AVX2-only CPUs) makes a step several times slower than fp32
        job.bf16 = native_bf16(target.device)
    target.model.requires_grad_(False)
    torch.manual_seed(job.seed)
    return rank, world, target


def launch(job: TrainRun, world: int, rank: int, model: torch.nn.Module, trainable: list, data: list, loss_fn,
           model_dir: str = "drafter", save_model=None) -> dict:
    """Write train_args.json and run the shared training loop; the model is saved to `out/model_dir` by
    `save_model(folder)` (default: its save_pretrained)."""
    from .trainer import TrainConfig, batch_size_for, train

    cfg = TrainConfig(out=job.out, steps=job.steps, batch_size=job.batch_size, lr=job.lr,
                      save_every=job.save_every, log_every=job.log_every, keep_every=job.keep_every,
                      seed=job.seed, model_dir=model_dir)
    if rank == 0:
        Path(job.out).mkdir(parents=True, exist_ok=True)
        (Path(job.out) / "train_args.json").write_text(json.dumps(
            {"kind": job.kind, **vars(job), "batch_size": batch_size_for(job.batch_size, world), "world_size": world,
             "num_sequences": len(data),
             "trained_parameters": sum(p.numel() for p in trainable),
             "drafter_parameters": sum(p.numel() for p in model.parameters())}, indent=2, default=str))
    return train(model, trainable, data, loss_fn, cfg, save_model or model.save_pretrained, resume=not job.no_resume)
