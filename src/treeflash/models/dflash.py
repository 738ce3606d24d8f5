"""DFlash: a one-shot block drafter conditioned on the target's hidden states (DESIGN section 2).

A short stack of Qwen3-style decoder layers. The block is [last verified token, mask x (γ-1)], bidirectional; the
target's tapped hidden states are concatenated, fused by `fc` + RMSNorm, and injected as extra keys/values into
every layer (through that layer's own k/v projections, k-norm and RoPE). The target's embedding and LM head are
reused, never stored in the drafter. Parameter names and config fields follow the published DFlash layout
(dflash_config.py), so those checkpoints load with `from_pretrained` too (dflash_io.py).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..runtime.transfer import upload
from ..runtime import int4, packed
from ..runtime.int4 import KEPT_DENSE_ROWS, Int4Linear, Int4Weight
from . import dflash_io
from .ar_layer import ARApproximation
from .blocks import BlocksOverContext, Layer, RMSNorm
from .checkpoint import DrafterError, misfits
from .dflash_config import DFlashConfig


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

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Keys and values [layers, kv_heads, m, head_dim] of m new positions (`DFlashDrafter.context_states`)."""
        m = k.shape[2]
        self.reserve(self.length + m)
        self.k[:, :, self.length:self.length + m] = k
        self.v[:, :, self.length:self.length + m] = v
        self.length += m

    def layers(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer, views of the context's (k, v) [length, kv_heads, head_dim]."""
        return [(k[:, :self.length].transpose(0, 1), v[:, :self.length].transpose(0, 1))
                for k, v in zip(self.k, self.v)]


class DFlashDrafter(nn.Module):
    """The block drafter. `embed` and `lm_head` are the target's modules, attached, not owned (not saved)."""

    # training: recompute each layer's activations in the backward pass instead of keeping them (less memory for
    # the anchors of long sequences on wide targets, one more forward of the layers)
    gradient_checkpointing = False

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
        self._head_cast: tuple | None = None  # (the head's weight, its cast rows, their packed or 4-bit copy or None)
        self.head_int4 = False  # inference: score with the head's rows rounded to 4 bits (`load_drafter_model`)
        self.draft_vocab: torch.Tensor | None = None  # inference only: token ids the LM head scores (use_draft_vocab)
        self.backbone_folder: Path | None = None  # loaded as an AR layer over this DFlash folder (see save_pretrained)
        self.compiled_block: tuple | None = None  # (the compiled block forward, its weights): `compile_block`
        self.compiled_context: Callable | None = None  # the compiled catch-up (taps, positions): `compile_block` too
        self.apply(self._init)
        self.ar_layer = None
        if c.ar_layer:
            self.add_ar_layer(**c.ar_layer)

    def add_ar_layer(self, kind: str = "swiglu", prev_tokens: int = 1, intermediate_size: int | None = None):
        """Turn this DFlash drafter into a TreeFlash drafter (a fresh AR layer is the identity)."""
        c = self.config
        c.ar_layer = {"kind": kind, "prev_tokens": prev_tokens,
                      "intermediate_size": intermediate_size or c.intermediate_size}
        self.ar_layer = ARApproximation(c.hidden_size, c.ar_layer["intermediate_size"], kind, prev_tokens,
                                        c.rms_norm_eps).to(self.fc.weight.device, self.fc.weight.dtype)
        return self

    def add_layers(self, n: int) -> "DFlashDrafter":
        """n more draft layers on top, each a copy of the last with its output projections zeroed: each adds
        exactly zero to the residual stream, so the grown drafter drafts what this one did, and training opens
        them up from features the last layer already computes (growth that keeps what was learned)."""
        for _ in range(n):
            layer = copy.deepcopy(self.layers[-1])
            with torch.no_grad():
                layer.self_attn.o_proj.weight.zero_()
                layer.mlp.down_proj.weight.zero_()
            self.layers.append(layer)
        self.config.num_hidden_layers = len(self.layers)
        return self

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=0.02)

    # ---- the target's modules -------------------------------------------------------------------------------
    def attach(self, target_model) -> "DFlashDrafter":
        """Use the target's input embedding and LM head; refuse a target this drafter does not fit."""
        problems = misfits(self.config, target_model.config.get_text_config(decoder=True))
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

    @torch.no_grad()
    def context_states(self, taps: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Inference: the fused features [m, H] of m committed positions (the target's taps [m, n_taps, H]) at
        `positions` [m], and their injected keys and values, each [layers, kv_heads, m, head_dim] (what a
        ContextCache appends). Compiled after `compile_block`; `fuse` and `context_kv` are the reference."""
        if self.compiled_context is not None:
            return self.compiled_context(taps, positions)
        fused = self.fuse(taps)
        kv = self.context_kv(fused, positions)
        return (fused, torch.stack([k.transpose(0, 1) for k, _ in kv]),
                torch.stack([v.transpose(0, 1) for _, v in kv]))

    def block_tokens(self, first_tokens: torch.Tensor) -> torch.Tensor:
        """Token ids [N, γ] of N blocks [token, mask x (γ-1)]."""
        c = self.config
        tokens = torch.full((len(first_tokens), c.block_size), c.mask_token_id, dtype=torch.long,
                            device=first_tokens.device)
        tokens[:, 0] = first_tokens
        return tokens

    def block_inputs(self, first_tokens: torch.Tensor) -> torch.Tensor:
        """Embeddings [N * γ, H] of N blocks [token, mask x (γ-1)]."""
        c = self.config
        if c.mask_token_id is not None:
            return self.embed(self.block_tokens(first_tokens)).flatten(0, 1)
        first = self.embed(first_tokens)[:, None]  # [N, 1, H]
        masks = self.mask_embedding.to(first.dtype).expand(len(first_tokens), c.block_size - 1, -1)
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
            if self.gradient_checkpointing and torch.is_grad_enabled():
                h = checkpoint(layer, h, positions, k, v, mask, use_reentrant=False)
            else:
                h = layer(h, positions, k, v, mask)
        return h

    def forward(self, anchors: torch.Tensor, tokens: torch.Tensor, taps: torch.Tensor,
                prev_tokens: torch.Tensor | None = None, lengths: torch.Tensor | None = None) -> torch.Tensor:
        """Training: pre-norm states [N, γ-1, H] of the drafted positions of the N blocks anchored at `anchors` [N]
        of a sequence `tokens` [S] whose context is the target's taps [S, n_taps, H]. Each block starts with its
        anchor's token and sees the context before it (`BlocksOverContext`), and only its first lengths[n]
        positions where `lengths` [N] is given (the states past them are not a short block's). With an AR layer,
        `prev_tokens` [N, γ-1, p] are the (teacher-forced) previous tokens of each drafted position, oldest first."""
        g = self.config.block_size
        ctx_kv = self.context_kv(self.fuse(taps), torch.arange(len(taps), device=taps.device))
        x = self.block_inputs(tokens[anchors]).unflatten(0, (len(anchors), g))
        positions = anchors[:, None] + torch.arange(g, device=anchors.device)
        h = self.hidden(x, positions, ctx_kv, BlocksOverContext(anchors, lengths))[:, 1:]
        if self.ar_layer is not None and prev_tokens is not None:
            h = self.ar_layer(h, self.norm(h), self.embed(prev_tokens).to(h.dtype))
        return h

    def scores(self, h: torch.Tensor) -> torch.Tensor:
        """Final norm, then the target's LM head on the scored tokens (the draft vocabulary, else all) [..., S], in
        the drafter's dtype: a bf16 drafter over an fp32 target multiplies by a bf16 copy of the head's rows (made
        once, and packed where `packed` can, or rounded to 4 bits with `head_int4`), the costliest product of a
        drafting round."""
        x = self.norm(h).to(self.fc.weight.dtype)
        head = self.lm_head
        if self._head_cast is None or self._head_cast[0] is not head.weight:
            rows = head.weight.detach() if self.draft_vocab is None else head.weight.detach()[self.draft_vocab]
            rows = rows.to(x.dtype).contiguous()
            # for inference only: training multiplies by the plain rows, so a copy would only cost memory
            if torch.is_grad_enabled():
                copy = None
            elif self.head_int4:  # (many rows, a batch's, multiply by the bf16 rows: KEPT_DENSE_ROWS)
                copy = Int4Linear([Int4Weight.from_ints(*int4.quantise(rows), torch.bfloat16)], weight=rows,
                                  dense_rows=KEPT_DENSE_ROWS)
            else:
                copy = packed.pack(rows)
            self._head_cast = (head.weight, rows, copy)
        _, rows, copy = self._head_cast
        bias = getattr(head, "bias", None)
        if bias is not None and self.draft_vocab is not None:
            bias = bias[self.draft_vocab]
        if isinstance(copy, Int4Linear) and not torch.is_grad_enabled():
            return copy(x) if bias is None else copy(x) + bias
        return packed.linear(x, rows, copy, bias)

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
    def draft_states(self, root: int, position: int, ctx_kv, depth: int | None = None) -> torch.Tensor:
        """Inference: pre-norm states [depth, H] of the first `depth` drafted positions (None: all γ - 1) of the
        block after `root` (at `position`), given the cached context K/V. The compiled forward runs its last layer
        on those positions only; the eager one (the reference) runs every position."""
        device, g = self.fc.weight.device, self.config.block_size
        depth = g - 1 if depth is None else min(depth, g - 1)
        roots = upload(torch.tensor([root]), device)
        size = self.block_rows(depth + 1)
        if self.compiled_block is not None and isinstance(ctx_kv, ContextCache) and position == len(ctx_kv):
            forward, weights = self.compiled_block
            return forward(self.block_tokens(roots)[0, :size], position, depth + 1, ctx_kv.k, ctx_kv.v, *weights)[1:]
        x = self.block_inputs(roots)[:size]
        positions = position + torch.arange(size, device=device)
        return self.hidden(x, positions, ctx_kv, None)[1:depth + 1]

    def block_rows(self, rows: int) -> int:
        """The positions of a block whose first `rows` states a tree reads: those only for a drafter trained for
        short blocks, else all γ (the block attends to itself both ways: its first states depend on the rest)."""
        return rows if self.config.short_blocks else self.config.block_size

    @torch.no_grad()
    def compile_block(self) -> "DFlashDrafter":
        """Run `draft_states` over a ContextCache and `context_states` through forwards compiled ahead of time
        (`compiled_block.py`) from now on, loaded or built here, on a snapshot of the weights (inference only: call
        it again after they change). Raises ValueError for a drafter without a compiled form; where inductor fails,
        the drafter stays eager and the error propagates."""
        from .compiled_block import block_weights, compile_block, compile_context, context_weights, product_tensors

        self.compiled_block = self.compiled_context = None
        c, dtype, p = self.config, self.fc.weight.dtype, product_tensors(self)
        weights, catch_up_weights = block_weights(self), context_weights(self)
        forward = compile_block(c, dtype, weights, p)
        catch_up = compile_context(c, dtype, catch_up_weights, p)
        if p == 1:
            self.compiled_context = lambda taps, positions: catch_up(taps, positions, *catch_up_weights)
        else:  # many positions (a prompt's) on the dense copies, as their eager `Int4Linear`s do
            dense_weights = context_weights(self, dense=True)
            dense = compile_context(c, dtype, dense_weights, 1)
            self.compiled_context = lambda taps, positions: (
                dense(taps, positions, *dense_weights) if len(taps) >= KEPT_DENSE_ROWS
                else catch_up(taps, positions, *catch_up_weights))
        self.compiled_block = (forward, weights)
        return self

    @torch.no_grad()
    def draft_states_batch(self, roots: list[int], contexts: list[ContextCache]) -> torch.Tensor:
        """`draft_states` of B sequences in one forward: [B, γ - 1, H]. Each block sees its own context (padded to
        the longest, masked) and its own block, whole (also for a drafter trained for short blocks, which drafts
        from whole ones too); positions follow each context."""
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

    # ---- save / load: dflash_io ------------------------------------------------------------------------------
    def save_pretrained(self, folder: str | Path, dtype: torch.dtype = torch.bfloat16,
                        backbone: str | Path | None = None) -> None:
        """In the published layouts; with `backbone`, the AR layer alone against that DFlash folder (an adapter)."""
        dflash_io.save_drafter(self, folder, dtype, backbone)

    def save_dflash(self, folder: str | Path, dtype: torch.dtype = torch.bfloat16) -> None:
        """The DFlash drafter alone (of a TreeFlash drafter: its backbone), in the published DFlash format."""
        dflash_io.save_dflash(self, folder, dtype)

    @classmethod
    def from_pretrained(cls, folder: str | Path, dtype: torch.dtype = torch.float32) -> "DFlashDrafter":
        return dflash_io.load_drafter(cls, folder, dtype)
