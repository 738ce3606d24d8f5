"""DFlash: a one-shot block drafter conditioned on the target's hidden states (DESIGN section 2).

A short stack of Qwen3-style decoder layers. The block is [last verified token, mask x (γ-1)], bidirectional; the
target's tapped hidden states are concatenated, fused by `fc` + RMSNorm, and injected as extra keys/values into
every layer (through that layer's own k/v projections, k-norm and RoPE). The target's embedding and LM head are
reused, never stored in the drafter. Parameter names and config fields follow the published DFlash layout, so
those checkpoints load with `from_pretrained` too.
"""

from __future__ import annotations

import dataclasses
import json
import os
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn

from . import packed
from .blocks import BlocksOverContext, Layer, RMSNorm
from .checkpoint import (DrafterError, load_strict, parse_config, read_config, read_weights, save_checkpoint,
                         weights_digest)


def tap_layers(num_target_layers: int, n: int) -> list[int]:
    """DFlash's evenly spaced taps: round(1 + i (L - 4) / (n - 1)); the middle layer when n == 1."""
    if n == 1:
        return [num_target_layers // 2]
    return [round(1 + i * (num_target_layers - 4) / (n - 1)) for i in range(n)]


def choose_mask_token(tokenizer) -> int:
    """The token that fills a block's drafted positions, as the published DFlash format wants it: the tokenizer's
    mask token; else one of its special tokens that neither marks turns nor ends text, by preference one named
    mask, reserved or unused, else the last (SmolLM2: `<empty_output>`, 16). Its embedding is the target's own row."""
    if tokenizer is None:
        raise DrafterError("a DFlash drafter needs a mask token id and this target has no tokenizer: pass --mask-token")
    if tokenizer.mask_token_id is not None:
        return int(tokenizer.mask_token_id)
    taken = {tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.unk_token_id}
    template = getattr(tokenizer, "chat_template", None) or ""
    special = [(i, str(t)) for i, t in sorted(getattr(tokenizer, "added_tokens_decoder", {}).items())
               if getattr(t, "special", False) and i not in taken and str(t) not in template]
    if not special:
        raise DrafterError("the tokenizer has no mask token and no spare special token: pass --mask-token ID")
    for hint in ("mask", "reserved", "unused"):
        named = [i for i, text in special if hint in text.lower()]
        if named:
            return named[0]
    return special[-1][0]


@dataclass
class DFlashConfig:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    num_target_layers: int
    target_layer_ids: list[int]
    block_size: int = 16
    # the published format: a real token id of the target's vocabulary, embedded by the target's own row
    # (choose_mask_token); None: a learned mask embedding, the deprecated layout of older treeflash drafters
    mask_token_id: int | None = None
    # FR-Spec: at inference the LM head scores only the N most frequent tokens of the regenerated answers
    # (token_ranking.json, written by `treeflash data rank`); None: the whole vocabulary
    draft_vocab_size: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1e6
    # TreeFlash: {"kind": "swiglu"|"linear", "prev_tokens": 1|2, "intermediate_size": I}; None for plain DFlash
    ar_layer: dict | None = None
    extra: dict = field(default_factory=dict)  # unknown fields of a published config, kept on save

    @classmethod
    def for_target(cls, target_config, num_layers: int = 3, num_taps: int = 5, block_size: int = 16,
                   intermediate_size: int | None = None, mask_token_id: int | None = None) -> "DFlashConfig":
        """A drafter at the target's width, heads and RoPE, tapping `num_taps` evenly spaced target layers, that
        fills its blocks with `mask_token_id` (see choose_mask_token)."""
        c = target_config
        heads = c.num_attention_heads
        rope = getattr(c, "rope_parameters", None) or {}
        return cls(hidden_size=c.hidden_size, intermediate_size=intermediate_size or c.intermediate_size,
                   num_hidden_layers=num_layers, num_attention_heads=heads,
                   num_key_value_heads=getattr(c, "num_key_value_heads", heads),
                   head_dim=getattr(c, "head_dim", None) or c.hidden_size // heads, vocab_size=c.vocab_size,
                   num_target_layers=c.num_hidden_layers,
                   target_layer_ids=tap_layers(c.num_hidden_layers, num_taps), block_size=block_size,
                   mask_token_id=mask_token_id,
                   rms_norm_eps=c.rms_norm_eps, rope_theta=rope.get("rope_theta", getattr(c, "rope_theta", 1e6)))

    def to_json(self) -> dict:
        d = asdict(self)
        extra = d.pop("extra")
        # the DFlash layout: Qwen3 fields plus dflash_config
        d["dflash_config"] = {"block_size": d["block_size"], "mask_token_id": d.pop("mask_token_id"),
                              "target_layer_ids": d.pop("target_layer_ids")}
        d["rope_parameters"] = {"rope_theta": d.pop("rope_theta"), "rope_type": "default"}
        ar, architecture = d.pop("ar_layer"), "DFlashDraftModel"
        if ar and self.published_treeflash:
            d["treeflash_config"] = {"ar_approximation": "swiglu", "candidate_tokens": 16}
            architecture = "TreeFlashDraftModel"
        elif ar:
            d["treeflash_config"] = {"ar_approximation": ar}
        return {**extra, "architectures": [architecture], "model_type": "qwen3", **d}

    @property
    def published_treeflash(self) -> bool:
        """Whether the published TreeFlash layout can express this drafter: a mask token id, and an AR layer that
        is a SwiGLU on one previous token, as wide as the drafter's MLP."""
        ar = self.ar_layer or {}
        return self.mask_token_id is not None and ar.get("kind") == "swiglu" and ar.get("prev_tokens") == 1 \
            and ar.get("intermediate_size") == self.intermediate_size

    @classmethod
    def from_json(cls, d: dict) -> "DFlashConfig":
        d = dict(d)
        dflash = d.pop("dflash_config", {}) or {}
        rope = d.pop("rope_parameters", None) or {}
        n_target = d.get("num_target_layers")
        layer_ids = dflash.get("target_layer_ids") or d.pop("target_layer_ids", None)
        if layer_ids is None:
            if n_target is None:
                raise DrafterError("drafter config has neither target_layer_ids nor num_target_layers")
            layer_ids = tap_layers(n_target, d.get("num_hidden_layers", 5))
        ar = (d.pop("treeflash_config", None) or {}).get("ar_approximation")
        if ar == "swiglu":  # the published TreeFlash layout: one previous token, the MLP's width
            ar = {"kind": "swiglu", "prev_tokens": 1, "intermediate_size": d["intermediate_size"]}
        known = {f for f in cls.__dataclass_fields__ if f not in ("extra", "ar_layer")}
        kwargs = {k: d.pop(k) for k in list(d) if k in known}
        kwargs.update(
            target_layer_ids=list(layer_ids),
            block_size=dflash.get("block_size", kwargs.get("block_size", 16)),
            mask_token_id=dflash.get("mask_token_id", kwargs.get("mask_token_id")),
            rope_theta=rope.get("rope_theta", d.pop("rope_theta", kwargs.get("rope_theta", 1e6))),
        )
        kwargs.setdefault("head_dim", kwargs["hidden_size"] // kwargs["num_attention_heads"])
        kwargs.setdefault("num_target_layers", max(layer_ids) + 1)
        d.pop("architectures", None)  # written anew on save (DFlash or TreeFlash)
        return cls(**kwargs, ar_layer=ar if isinstance(ar, dict) else None, extra=d)


class ContextCache:
    """The injected context K/V of one sequence in preallocated buffers [layers, kv_heads, capacity, head_dim]
    (head-major, so that a layer's context is one strided view per head, the layout SDPA's kernels read): appending
    copies only the new positions, and a drafting forward writes its block's K/V after the context in place
    (nothing is concatenated per round). The buffers double when they must grow."""

    def __init__(self, model: "DFlashDrafter", capacity: int = 512):
        c, w = model.config, model.fc.weight
        shape = (c.num_hidden_layers, c.num_key_value_heads, capacity, c.head_dim)
        self.k, self.v = w.new_zeros(shape), w.new_zeros(shape)
        self.length = 0

    def __len__(self) -> int:
        return self.length

    def reserve(self, length: int) -> None:
        if length > self.k.shape[2]:
            k, v = self.k, self.v
            shape = (*k.shape[:2], max(length, 2 * k.shape[2]), k.shape[3])
            self.k, self.v = k.new_zeros(shape), v.new_zeros(shape)
            self.k[:, :, :self.length], self.v[:, :, :self.length] = k[:, :, :self.length], v[:, :, :self.length]

    def append(self, kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Per layer (k, v) [m, kv_heads, head_dim] of m new positions."""
        m = len(kv[0][0])
        self.reserve(self.length + m)
        for i, (k, v) in enumerate(kv):
            self.k[i, :, self.length:self.length + m] = k.transpose(0, 1)
            self.v[i, :, self.length:self.length + m] = v.transpose(0, 1)
        self.length += m

    def layers(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer, views of the context's (k, v) [length, kv_heads, head_dim]."""
        return [(k[:, :self.length].transpose(0, 1), v[:, :self.length].transpose(0, 1))
                for k, v in zip(self.k, self.v)]


class DFlashDrafter(nn.Module):
    """The block drafter. `embed` and `lm_head` are the target's modules, attached, not owned (not saved)."""

    def __init__(self, config: DFlashConfig):
        super().__init__()
        c = self.config = config
        self.fc = nn.Linear(len(c.target_layer_ids) * c.hidden_size, c.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.layers = nn.ModuleList(Layer(c) for _ in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        if c.mask_token_id is None:  # deprecated (older treeflash drafters): a learned mask embedding
            self.mask_embedding = nn.Parameter(0.02 * torch.randn(c.hidden_size))
        self._target = ()  # (embed, lm_head): a tuple, so that they are not registered as submodules
        self._head_cast: tuple | None = None  # (the head's weight, its cast rows, their packed copy or None)
        self.draft_vocab: torch.Tensor | None = None  # inference only: token ids the LM head scores (use_draft_vocab)
        self.backbone_folder: Path | None = None  # loaded as an AR layer over this DFlash folder (see save_pretrained)
        self.apply(self._init)
        self.ar_layer = None
        if c.ar_layer:
            self.add_ar_layer(**c.ar_layer)

    def add_ar_layer(self, kind: str = "swiglu", prev_tokens: int = 1, intermediate_size: int | None = None):
        """Turn this DFlash drafter into a TreeFlash drafter (a fresh AR layer is the identity)."""
        from .ar_layer import ARApproximation

        c = self.config
        c.ar_layer = {"kind": kind, "prev_tokens": prev_tokens,
                      "intermediate_size": intermediate_size or c.intermediate_size}
        self.ar_layer = ARApproximation(c.hidden_size, c.ar_layer["intermediate_size"], kind, prev_tokens,
                                        c.rms_norm_eps).to(self.fc.weight.device, self.fc.weight.dtype)
        return self

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=0.02)

    # ---- the target's modules -------------------------------------------------------------------------------
    def attach(self, target_model) -> "DFlashDrafter":
        """Use the target's input embedding and LM head; refuse a target this drafter does not fit."""
        c, tc = self.config, target_model.config.get_text_config(decoder=True)
        problems = []
        if tc.hidden_size != c.hidden_size:
            problems.append(f"hidden size {c.hidden_size} vs the target's {tc.hidden_size}")
        if tc.vocab_size != c.vocab_size:
            problems.append(f"vocabulary {c.vocab_size} vs the target's {tc.vocab_size}")
        if max(c.target_layer_ids) >= tc.num_hidden_layers:
            problems.append(f"taps layers {c.target_layer_ids}, the target has {tc.num_hidden_layers}")
        if problems:
            raise DrafterError("this drafter does not fit the target: " + "; ".join(problems))
        self._target = (target_model.get_input_embeddings(), target_model.get_output_embeddings())
        return self

    @property
    def embed(self) -> nn.Module:
        if not self._target:
            raise RuntimeError("attach(target_model) first: the drafter uses the target's embedding and LM head")
        return self._target[0]

    @property
    def lm_head(self) -> nn.Module:
        # a target whose head is tied to its embedding may have no output module of its own
        return self._target[1] if self._target and self._target[1] is not None else self.embed

    # ---- forward pieces ---------------------------------------------------------------------------------------
    def fuse(self, taps: torch.Tensor) -> torch.Tensor:
        """Context features [C, H] from the target's tapped hidden states [C, n_taps, H]."""
        return self.hidden_norm(self.fc(taps.flatten(-2).to(self.fc.weight.dtype)))

    def context_kv(self, ctx: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer, the injected keys/values of fused context features ctx [C, H] at `positions` [C]."""
        return [layer.self_attn.kv(ctx, positions) for layer in self.layers]

    def block_inputs(self, first_tokens: torch.Tensor) -> torch.Tensor:
        """Embeddings [N * γ, H] of N blocks [token, mask x (γ-1)]."""
        c = self.config
        n = first_tokens.shape[0]
        if c.mask_token_id is not None:
            tokens = torch.full((n, c.block_size), c.mask_token_id, dtype=torch.long, device=first_tokens.device)
            tokens[:, 0] = first_tokens
            return self.embed(tokens).flatten(0, 1)
        first = self.embed(first_tokens)[:, None]  # [N, 1, H]
        masks = self.mask_embedding.to(first.dtype).expand(n, c.block_size - 1, -1)
        return torch.cat([first, masks], dim=1).flatten(0, 1)

    def hidden(self, x: torch.Tensor, positions: torch.Tensor, ctx_kv, mask: torch.Tensor | None) -> torch.Tensor:
        """Final block states, before the final norm (where TreeFlash's AR layer acts). `ctx_kv`: per layer
        (k, v) of the context, or a ContextCache."""
        h = x.to(self.fc.weight.dtype)
        if isinstance(ctx_kv, ContextCache):
            ctx_kv.reserve(len(ctx_kv) + len(x))
            for layer, k, v in zip(self.layers, ctx_kv.k, ctx_kv.v):
                h = layer(h, positions, k, v, mask, len(ctx_kv))
            return h
        for layer, (k, v) in zip(self.layers, ctx_kv):
            h = layer(h, positions, k, v, mask)
        return h

    def forward(self, anchors: torch.Tensor, tokens: torch.Tensor, taps: torch.Tensor,
                prev_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """Training: pre-norm states [N, γ-1, H] of the drafted positions of the N blocks anchored at `anchors` [N]
        of a sequence `tokens` [S] whose context is the target's taps [S, n_taps, H]. Each block starts with its
        anchor's token and sees the context before it (`BlocksOverContext`). With an AR layer, `prev_tokens`
        [N, γ-1, p] are the (teacher-forced) previous tokens of each drafted position, oldest first."""
        g = self.config.block_size
        ctx_kv = self.context_kv(self.fuse(taps), torch.arange(len(taps), device=taps.device))
        x = self.block_inputs(tokens[anchors]).unflatten(0, (len(anchors), g))
        positions = anchors[:, None] + torch.arange(g, device=anchors.device)
        h = self.hidden(x, positions, ctx_kv, BlocksOverContext(anchors))[:, 1:]
        if self.ar_layer is not None and prev_tokens is not None:
            h = self.ar_layer(h, self.norm(h), self.embed(prev_tokens).to(h.dtype))
        return h

    def scores(self, h: torch.Tensor) -> torch.Tensor:
        """Final norm, then the target's LM head on the scored tokens (the draft vocabulary, else all) [..., S], in
        the drafter's dtype: a bf16 drafter over an fp32 target multiplies by a bf16 copy of the head's rows (made
        once, and packed where `packed` can), the costliest product of a drafting round."""
        x = self.norm(h).to(self.fc.weight.dtype)
        head = self.lm_head
        if self._head_cast is None or self._head_cast[0] is not head.weight:
            rows = head.weight.detach() if self.draft_vocab is None else head.weight.detach()[self.draft_vocab]
            rows = rows.to(x.dtype).contiguous()
            # packed for inference only: training multiplies by the plain rows, so a packed copy would only cost memory
            self._head_cast = (head.weight, rows, None if torch.is_grad_enabled() else packed.pack(rows))
        bias = getattr(head, "bias", None)
        if bias is not None and self.draft_vocab is not None:
            bias = bias[self.draft_vocab]
        return packed.linear(x, self._head_cast[1], self._head_cast[2], bias)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Logits over the whole vocabulary [..., V]: `scores`, with -inf for the tokens outside the draft vocabulary."""
        scores = self.scores(h)
        if self.draft_vocab is None:
            return scores
        out = scores.new_full((*scores.shape[:-1], self.config.vocab_size), float("-inf"))
        return out.index_copy_(-1, self.draft_vocab, scores)

    def top_tokens(self, h: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The k most likely tokens of each state's marginal, most likely first: (logits, probabilities, token ids),
        each [..., k]. What `torch.softmax(logits(h)).topk(k)` gives, without a softmax or a top-k over the whole
        vocabulary (7 ms on a 2-core CPU at 15 x 49,152; 0.7 ms over a 4,096-token draft vocabulary)."""
        scores = self.scores(h).float()
        logits, index = scores.topk(min(k, scores.shape[-1]), dim=-1)
        probs = (logits - scores.logsumexp(-1, keepdim=True)).exp()
        return logits, probs, index if self.draft_vocab is None else self.draft_vocab[index]

    def use_draft_vocab(self, token_ids: torch.Tensor | None) -> "DFlashDrafter":
        """Score only these tokens (None: all): at inference, and in training, whose loss is then taken over them."""
        self.draft_vocab = None if token_ids is None else token_ids.sort().values.to(self.fc.weight.device)
        self._head_cast = None
        return self

    @torch.no_grad()
    def draft_states(self, root: int, position: int, ctx_kv) -> torch.Tensor:
        """Inference: pre-norm states [γ - 1, H] of the drafted positions of the block after `root` (at
        `position`), given the cached context K/V."""
        device = self.fc.weight.device
        x = self.block_inputs(torch.tensor([root], device=device))
        positions = position + torch.arange(self.config.block_size, device=device)
        return self.hidden(x, positions, ctx_kv, None)[1:]

    @torch.no_grad()
    def draft_states_batch(self, roots: list[int], contexts: list[ContextCache]) -> torch.Tensor:
        """`draft_states` of B sequences in one forward: [B, γ - 1, H]. Each block sees its own context (padded to
        the longest, masked) and its own block; positions follow each context."""
        device, T = self.fc.weight.device, self.config.block_size
        x = self.block_inputs(torch.tensor(roots, device=device)).unflatten(0, (len(roots), T))
        lengths = torch.tensor([len(c) for c in contexts], device=device)
        positions = lengths[:, None] + torch.arange(T, device=device)
        longest = int(lengths.max())
        keys = torch.arange(longest + T, device=device)
        mask = ((keys < lengths[:, None]) | (keys >= longest))[:, None, None, :]  # [B, 1, 1, C + T]
        h = x.to(self.fc.weight.dtype)
        for i, layer in enumerate(self.layers):
            k = nn.utils.rnn.pad_sequence([c.k[i, :, :len(c)].transpose(0, 1) for c in contexts], batch_first=True)
            v = nn.utils.rnn.pad_sequence([c.v[i, :, :len(c)].transpose(0, 1) for c in contexts], batch_first=True)
            h = layer(h, positions, k, v, mask)
        return h[:, 1:]

    @torch.no_grad()
    def draft_logits(self, root: int, position: int, ctx_kv) -> torch.Tensor:
        """The DFlash marginals: logits [γ - 1, V] of the drafted positions."""
        return self.logits(self.draft_states(root, position, ctx_kv)).float()

    def dflash_folder(self, folder: str | Path) -> Path | None:
        """The folder of the DFlash drafter this one (loaded from `folder`) runs on, what a Weaver is checked
        against: a TreeFlash adapter's backbone, a DFlash drafter's own folder, None for a TreeFlash drafter saved
        whole (its DFlash weights are in no folder of their own)."""
        if self.backbone_folder is not None:
            return self.backbone_folder
        return Path(folder) if self.ar_layer is None else None

    # ---- save / load -------------------------------------------------------------------------------------------
    def save_pretrained(self, folder: str | Path, dtype: torch.dtype = torch.bfloat16,
                        backbone: str | Path | None = None) -> None:
        """config.json + model.safetensors, in the published layouts: DFlash's, and TreeFlash's (the backbone under
        `model.`, the AR layer as `ar_approximation`) where it can express the AR layer (see ar_layer.py).
        With `backbone` (the DFlash drafter folder this TreeFlash drafter was trained on, frozen), only the AR layer
        is saved, and the config points to the backbone (relative path, and the hash of its weights, checked on
        load): an adapter, as PEFT saves them."""
        state = self.state_dict()
        if backbone is None and self.ar_layer is not None and self.config.published_treeflash:
            published = {k.replace("ar_layer.", "ar_approximation.", 1) if k.startswith("ar_layer.")
                         else "model." + k: v for k, v in state.items()}
            return save_checkpoint(published, self.config.to_json(), folder, dtype)
        if backbone is None:  # DFlash, or a TreeFlash drafter the published layout cannot express
            return save_checkpoint(state, self.config.to_json(), folder, dtype)
        if self.ar_layer is None:
            raise ValueError("only a TreeFlash drafter (with an AR layer) can be saved against a backbone")
        config = self.config.to_json()
        config["treeflash_config"]["backbone"] = os.path.relpath(Path(backbone).resolve(), Path(folder).resolve())
        config["treeflash_config"]["backbone_sha256"] = weights_digest(Path(backbone))
        save_checkpoint({k: v for k, v in state.items() if k.startswith("ar_layer.")}, config, folder, dtype)

    def save_dflash(self, folder: str | Path, dtype: torch.dtype = torch.bfloat16) -> None:
        """The DFlash drafter alone (of a TreeFlash drafter: its backbone), in the published DFlash format."""
        config = dataclasses.replace(self.config, ar_layer=None).to_json()
        state = {k: v for k, v in self.state_dict().items() if not k.startswith("ar_layer.")}
        save_checkpoint(state, config, folder, dtype)

    @classmethod
    def from_pretrained(cls, folder: str | Path, dtype: torch.dtype = torch.float32) -> "DFlashDrafter":
        folder = Path(folder)
        raw = read_config(folder)
        backbone = (raw.get("treeflash_config") or {}).get("backbone")
        if backbone is not None:
            return cls._from_adapter(folder, raw, dtype)
        model = cls(parse_config(DFlashConfig.from_json, raw, folder))
        if model.config.mask_token_id is None:
            _warn_learned_mask(folder)
        state = read_weights(folder)
        if any(k.startswith("model.") for k in state):  # the published TreeFlash layout: the backbone under model.
            state = {k.removeprefix("model.").replace("ar_approximation.", "ar_layer.", 1): v
                     for k, v in state.items()}
        # published checkpoints may carry the target's embedding / head: the target's own are used instead
        state = {k: v for k, v in state.items() if not k.startswith(("embed_tokens.", "lm_head."))}
        load_strict(model, _current_ar_layer(state, state.get("norm.weight")), str(folder))
        return model.to(dtype).eval()

    @classmethod
    def _from_adapter(cls, folder: Path, raw: dict, dtype: torch.dtype) -> "DFlashDrafter":
        """A TreeFlash drafter saved as its AR layer over a DFlash backbone folder (see save_pretrained)."""
        tf = raw["treeflash_config"]
        backbone = (folder / tf["backbone"]).resolve()
        if not (backbone / "config.json").is_file():
            raise DrafterError(f"the TreeFlash drafter in {folder} needs its DFlash backbone at {backbone}: not found")
        if tf.get("backbone_sha256") and tf["backbone_sha256"] != weights_digest(backbone):
            raise DrafterError(f"the DFlash backbone at {backbone} is not the one the TreeFlash drafter in {folder} "
                               "was trained on (its weights changed): retrain with `treeflash train treeflash`")
        model = cls.from_pretrained(backbone, dtype=torch.float32)
        if model.ar_layer is not None:
            raise DrafterError(f"the backbone of {folder} ({backbone}) is itself a TreeFlash drafter")
        model.add_ar_layer(**DFlashConfig.from_json(raw).ar_layer)
        state = read_weights(folder)
        if not all(k.startswith("ar_layer.") for k in state):
            raise DrafterError(f"{folder} points to a backbone, so it must hold AR-layer weights only")
        state = _current_ar_layer(state, model.norm.weight.detach())
        load_strict(model.ar_layer, {k.removeprefix("ar_layer."): v for k, v in state.items()}, str(folder))
        model.backbone_folder = backbone
        return model.to(dtype).eval()


def _current_ar_layer(state: dict[str, torch.Tensor], final_norm: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """A state dict whose AR layer (`ar_layer.*`) may be in treeflash's layout before the published one: converted
    (ar_layer.from_legacy); anything else unchanged."""
    from .ar_layer import from_legacy

    if "ar_layer.state_norm.weight" not in state:
        return state
    old = {k.removeprefix("ar_layer."): v for k, v in state.items() if k.startswith("ar_layer.")}
    rest = {k: v for k, v in state.items() if not k.startswith("ar_layer.")}
    return {**rest, **{"ar_layer." + k: v for k, v in from_legacy(old, final_norm).items()}}


def _warn_learned_mask(folder: Path) -> None:
    """The deprecation warning of the learned mask embedding, once per folder."""
    folder = folder.resolve()
    if folder in _warned:
        return
    _warned.add(folder)
    warnings.warn(f"the drafter in {folder} has a learned mask embedding instead of a mask token id: other engines "
                  "cannot load it, and treeflash will stop reading it; train it again (`treeflash train dflash` "
                  "picks a mask token)", FutureWarning, stacklevel=3)


_warned: set[Path] = set()

RANKING_FILE = "token_ranking.json"


def draft_vocab(model: DFlashDrafter, folder: str | Path, size: int | None = None) -> torch.Tensor | None:
    """The `size` (default: the config's draft_vocab_size; 0: all) most frequent tokens of the ranking saved with
    the drafter in `folder` (or with its backbone); None for the whole vocabulary."""
    size = model.config.draft_vocab_size if size is None else size
    if not size or size >= model.config.vocab_size:
        return None
    for where in (Path(folder), model.backbone_folder):
        if where is not None and (where / RANKING_FILE).is_file():
            ranking = json.loads((where / RANKING_FILE).read_text())["ranking"]
            if len(ranking) < size:
                raise DrafterError(f"{where / RANKING_FILE} ranks {len(ranking)} tokens, fewer than the {size} asked")
            return torch.tensor(ranking[:size])
    raise DrafterError(f"draft vocabulary of {size} tokens asked, but no {RANKING_FILE} with the drafter in {folder}: "
                       "write one with `treeflash data rank`")
