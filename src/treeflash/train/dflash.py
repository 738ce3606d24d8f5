"""`treeflash train dflash`: the DFlash block drafter on self-distilled data (DESIGN section 2).

Per sequence: one no-grad target forward gives the tapped hidden states (context features) and the target's
distribution at every position. Random anchors a in the answer each make a block [x_a, mask x (γ-1)] at
positions a..a+γ-1 that sees the context strictly before a and its own block, never another block; position k
learns the target's distribution of x_{a+k} by forward KL, weighted by exp(-(k-1)/7).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ..models.dflash import DFlashDrafter, DrafterError
from .losses import forward_kl, position_weights


@dataclass
class Sequence:
    tokens: torch.Tensor  # [S] prompt + answer
    prompt_len: int


@dataclass
class TargetView:
    taps: torch.Tensor  # [S, n_taps, H]
    logp: torch.Tensor  # [S, V] fp32: the target's log-distribution of the token after each position


def sequences(rows: list[dict], max_len: int, block_size: int) -> list[Sequence]:
    """Regenerated rows as training sequences, cut to max_len; rows without room for one block are dropped."""
    out = []
    for r in rows:
        ids = (r["prompt_ids"] + r["response_ids"])[:max_len]
        if len(ids) - len(r["prompt_ids"]) >= 2:
            out.append(Sequence(torch.tensor(ids), len(r["prompt_ids"])))
    return out


@torch.no_grad()
def target_view(target_model, tokens: torch.Tensor, taps: list[int]) -> TargetView:
    out = target_model(tokens[None].to(target_model.device), output_hidden_states=True)
    feats = torch.stack([out.hidden_states[i + 1][0] for i in taps], dim=1)
    return TargetView(feats, torch.log_softmax(out.logits[0].float(), dim=-1))


def sample_anchors(seq: Sequence, n: int, gen: torch.Generator) -> torch.Tensor:
    """Up to n distinct anchors in the answer: positions prompt_len .. S-2 (each predicts at least one token)."""
    first, last = seq.prompt_len, len(seq.tokens) - 2
    count = last - first + 1
    pick = torch.randperm(count, generator=gen)[: min(n, count)]
    return (first + pick).sort().values


def block_mask(anchors: torch.Tensor, context: int, block_size: int) -> torch.Tensor:
    """[N γ, S + N γ] bool: a block sees context positions before its anchor, and its own block."""
    block = torch.arange(len(anchors)).repeat_interleave(block_size)
    sees_context = torch.arange(context)[None, :] < anchors[block][:, None]
    return torch.cat([sees_context, block[:, None] == block[None, :]], dim=1)


def blocks(anchors: torch.Tensor, context: int, block_size: int):
    """The layout of one block per anchor [N]: positions [N γ], the mask [N γ, S + N γ] (`block_mask`), and the
    positions [N, γ-1] of the drafted tokens (some may lie past the sequence: check `< S`)."""
    g, device = block_size, anchors.device
    positions = (anchors[:, None] + torch.arange(g, device=device)).flatten()
    mask = block_mask(anchors.cpu(), context, g).to(device)
    return positions, mask, anchors[:, None] + torch.arange(1, g, device=device)


def dflash_loss(model: torch.nn.Module, seq: Sequence, view: TargetView, anchors: torch.Tensor,
                kl_topk: int = 0, decay: float = 7.0) -> tuple[torch.Tensor, dict]:
    """Weighted forward KL over all anchors' blocks of one sequence, and accuracy stats.

    `model` is the DFlashDrafter, or DistributedDataParallel around it (its forward must be the call)."""
    drafter: DFlashDrafter = getattr(model, "module", model)
    g, S, device = drafter.config.block_size, len(seq.tokens), view.taps.device
    anchors = anchors.to(device)
    positions, mask, predicted = blocks(anchors, S, g)
    tokens = seq.tokens.to(device)
    prev = None
    if drafter.ar_layer is not None:  # TreeFlash: teacher forcing, the true previous token(s)
        back = torch.arange(drafter.ar_layer.prev_tokens, 0, -1, device=device)
        prev = tokens[(predicted[:, :, None] - back).clamp(max=S - 1)]
    h = model(tokens[anchors], positions, view.taps, mask, prev)  # [N, γ-1, H]
    valid = predicted < S
    logits = drafter.logits(h[valid])
    target_logp = view.logp[predicted[valid] - 1]  # the target's distribution of x_t sits at position t - 1
    weights = position_weights(g, decay).to(device)[None].expand_as(predicted)[valid]
    kl = forward_kl(target_logp, logits, kl_topk)
    loss = (weights * kl).sum() / weights.sum()
    hit = (logits.argmax(-1) == target_logp.argmax(-1)).float()
    depth = torch.arange(1, g, device=device)[None].expand_as(predicted)[valid]
    return loss, {"loss": loss.item(), "kl": kl.mean().item(), "acc": hit.mean().item(),
                  "acc_k1": hit[depth == 1].mean().item(), "tokens": int(valid.sum())}


def run(args) -> dict:
    """`treeflash train dflash` and `treeflash train treeflash` (see cli.py for the arguments).

    A DFlash drafter starts fresh at the sizes given, or from a trained one (--init) with a new optimiser and
    learning-rate schedule: a second stage on more data, or a published drafter fine-tuned on one's own.

    TreeFlash starts from a trained DFlash backbone (--backbone), adds a zero-initialised AR layer and trains it,
    alone (--freeze-backbone) or with the backbone, on the same objective with teacher forcing. A TreeFlash
    drafter as --backbone continues: its AR layer is trained further (the --ar-* options are then its own). With
    --init, a DFlash backbone gets the AR layer of that TreeFlash drafter (its own settings) as a starting point."""
    from ..models.dflash import DFlashConfig

    rank, world, target = setup(args)
    if args.train_command == "treeflash":
        drafter = DFlashDrafter.from_pretrained(args.backbone).attach(target.model).to(target.device)
        # a TreeFlash drafter as --backbone goes on training its AR layer; an adapter is saved against its backbone
        saved_against = drafter.backbone_folder
        if drafter.ar_layer is None:
            if args.init:  # the AR layer of another TreeFlash drafter (e.g. of an older backbone) to start from
                source = DFlashDrafter.from_pretrained(args.init)
                if source.ar_layer is None:
                    raise DrafterError(f"--init {args.init} is not a TreeFlash drafter (it has no AR layer)")
                drafter.add_ar_layer(**source.config.ar_layer)
                drafter.ar_layer.load_state_dict(source.ar_layer.state_dict())
            else:
                drafter.add_ar_layer(args.ar_kind, args.prev_tokens, args.ar_intermediate_size)
            saved_against = args.backbone
        elif args.init:
            raise DrafterError(f"--backbone {args.backbone} has an AR layer already: --init needs a DFlash backbone")
        trainable = list((drafter.ar_layer if args.freeze_backbone else drafter).parameters())
    elif args.init:  # go on training a DFlash drafter (its own sizes: --layers etc. do not apply)
        drafter = DFlashDrafter.from_pretrained(args.init).attach(target.model).to(target.device)
        if drafter.ar_layer is not None:
            raise DrafterError(f"{args.init} is a TreeFlash drafter: go on training it with `treeflash train treeflash "
                               f"--backbone {args.init}`")
        trainable = list(drafter.parameters())
    else:
        config = DFlashConfig.for_target(target.config, num_layers=args.layers, num_taps=args.taps,
                                         block_size=args.block_size, intermediate_size=args.intermediate_size,
                                         mask_token_id=mask_token(args.mask_token, target))
        drafter = DFlashDrafter(config).attach(target.model).to(target.device)
        trainable = list(drafter.parameters())
    drafter.requires_grad_(False)
    for param in trainable:
        param.requires_grad_(True)
    config = drafter.config
    data = sequences(training_rows(args, target), args.max_len, config.block_size)
    taps = config.target_layer_ids
    autocast = torch.autocast(target.device.type, dtype=torch.bfloat16, enabled=args.bf16)

    def loss_fn(model, seq, gen):
        view = target_view(target.model, seq.tokens, taps)
        with autocast:
            return dflash_loss(model, seq, view, sample_anchors(seq, args.num_anchors, gen), args.kl_topk)

    save = drafter.save_pretrained
    if args.train_command == "treeflash" and args.freeze_backbone and saved_against is not None:
        save = functools.partial(drafter.save_pretrained, backbone=saved_against)  # the AR layer only
    return launch(args, world, rank, drafter, trainable, data, loss_fn, save_model=save)


def training_rows(args, target) -> list[dict]:
    """The rows of --data (answer stores), their prompts read back from --data-dir and encoded by the target."""
    from pathlib import Path

    from ..eval.datasets import default_data_dir
    from .store import load_answers

    return load_answers(args.data, target.encode_prompt, Path(args.data_dir) if args.data_dir else default_data_dir())


def mask_token(choice: str | None, target) -> int:
    """--mask-token: an id or a token's text of the target's vocabulary; None: choose_mask_token."""
    from ..models.dflash import choose_mask_token

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


def setup(args):
    """(rank, world size, the frozen target) for a training run; one CPU share per process under torchrun."""
    import os

    from ..target import Target
    from .trainer import init_distributed

    rank, world = init_distributed()
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    elif world > 1:
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    # the dense weights: training was measured on them (a GGUF target's int4 kernels have no gradients either)
    target = Target.load(args.target, dtype=args.target_dtype, device=args.device, quantize="none")
    target.model.requires_grad_(False)
    torch.manual_seed(args.seed)
    return rank, world, target


def launch(args, world: int, rank: int, model: torch.nn.Module, trainable: list, data: list, loss_fn,
           model_dir: str = "drafter", save_model=None) -> dict:
    """Write train_args.json and run the shared training loop; the model is saved to `out/model_dir` by
    `save_model(folder)` (default: its save_pretrained)."""
    import json
    from pathlib import Path

    from .trainer import TrainConfig, train

    cfg = TrainConfig(out=args.out, steps=args.steps, batch_size=args.batch_size, lr=args.lr,
                      save_every=args.save_every, log_every=args.log_every, keep_every=args.keep_every,
                      seed=args.seed, model_dir=model_dir)
    if rank == 0:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "train_args.json").write_text(json.dumps(
            {**vars(args), "world_size": world, "num_sequences": len(data),
             "trained_parameters": sum(p.numel() for p in trainable),
             "drafter_parameters": sum(p.numel() for p in model.parameters())}, indent=2, default=str))
    return train(model, trainable, data, loss_fn, cfg, save_model or model.save_pretrained, resume=not args.no_resume)
