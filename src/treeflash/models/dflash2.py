"""DFlash2: DFlash's block drafter with a grouped dynamic causal conv around every sub-layer and a low-rank
candidate selector that conditions each drafted slot on the previous slot's token (DESIGN section 5a).

The backbone is DFlash's (context taps -> `fc` -> `hidden_norm`, injected as keys/values; block = [anchor,
mask x (γ-1)], bidirectional; final `norm`, the target's LM head), built from the same pieces (blocks.py). What
DFlash2 adds:

- per layer, `attention_conv` and `mlp_conv`: with x_n the sub-layer's normed input and D = P(x_n) viewed
  [.., 2, Kc, G], Conv_s(z)[t, c] = Σ_{o<Kc} (W[s, o, c] + D[t, s, o, c // gs]) z[t - o, c]; the sub-layer reads
  Conv_0(x_n) and the residual stream gets Conv_1(its output). Causal over the block positions (zeros before the
  block's first), never over the context;
- `candidate_selector`: the top-K tokens C_d of each slot's logits U_d are rescored by
  s_d(c | p) = U_d[c] + Σ_r A[p]_r (P h_d)_r B[c]_r, p the previous slot's token (the anchor for the first slot);
- `input_embedding_scale` on the block's embeddings, `output_multiplier` and `final_logit_softcapping` on its
  logits.

Tensor names and config keys are those of the published format read by the reference implementation (PyPI
`dflash` 0.1.0, `DFlash2DraftModel`): `from_pretrained` reads such a folder, `save_pretrained` writes one.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from .blocks import MLP, Attention, RMSNorm
from .checkpoint import DrafterError, load_strict, parse_config, read_config, read_weights, save_checkpoint
from .dflash import DFlashDrafter
from .dflash_config import DFlashConfig

ARCHITECTURE = "DFlash2DraftModel"
CODEBOOKS = ("candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook")


@dataclass
class DFlash2Config:
    """What DFlash2 adds to a DFlash config; `backbone` is the DFlash part (widths, taps, block, mask token)."""

    backbone: DFlashConfig
    conv_kernel_size: int  # Kc: taps of the causal conv over the block
    conv_group_size: int  # gs: channels sharing one dynamic kernel (G = H / gs groups)
    selector_rank: int  # r of the codebooks
    selector_top_k: int  # K candidates per slot
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None

    OWN = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k", "input_embedding_scale",
           "output_multiplier", "final_logit_softcapping")

    @classmethod
    def for_target(cls, target_config, conv_kernel_size: int = 2, conv_group_size: int = 16, selector_rank: int = 256,
                   selector_top_k: int = 16, **backbone) -> "DFlash2Config":
        """Defaults: SpecForge's Qwen3.6-27B recipe (Kc 2, gs 16, r 256, K 16); `backbone` as DFlashConfig.for_target."""
        return cls(DFlashConfig.for_target(target_config, **backbone), conv_kernel_size, conv_group_size,
                   selector_rank, selector_top_k)

    @classmethod
    def from_json(cls, raw: dict) -> "DFlash2Config":
        """The reference reads each key from `dflash_config`, else from the top level."""
        raw = dict(raw)
        dflash = dict(raw.get("dflash_config") or {})
        own = {k: dflash.pop(k, raw.pop(k, None)) for k in cls.OWN}
        missing = [k for k in cls.OWN[:4] if own[k] is None]
        if missing:
            raise DrafterError(f"not a DFlash2 config: {', '.join(missing)} missing")
        backbone = DFlashConfig.from_json({**raw, "dflash_config": dflash})
        if backbone.mask_token_id is None:
            raise DrafterError("a DFlash2 config needs dflash_config.mask_token_id (a token of the target's vocabulary)")
        softcap = own["final_logit_softcapping"]
        return cls(backbone, *(int(own[k]) for k in cls.OWN[:4]),
                   input_embedding_scale=float(1.0 if own["input_embedding_scale"] is None
                                               else own["input_embedding_scale"]),
                   output_multiplier=float(1.0 if own["output_multiplier"] is None else own["output_multiplier"]),
                   final_logit_softcapping=None if softcap is None else float(softcap))

    def to_json(self) -> dict:
        d = self.backbone.to_json()
        d["architectures"] = [ARCHITECTURE]
        d["dflash_config"].update({k: v for k, v in asdict(self).items() if k != "backbone"})
        return d


class GroupedDynamicConv(nn.Module):
    """The conv pair around one sub-layer: side 0 on its input, side 1 on its output, both with kernels predicted
    from the same normed input. Starts as the identity (W[:, 0] = 1, other taps 0, P = 0)."""

    def __init__(self, hidden_size: int, kernel_size: int, group_size: int):
        super().__init__()
        if hidden_size % group_size:
            raise DrafterError(f"conv_group_size {group_size} does not divide the hidden size {hidden_size}")
        self.kernel_size, self.groups = kernel_size, hidden_size // group_size
        base = torch.zeros(2, kernel_size, hidden_size)
        base[:, 0] = 1
        self.base_kernel = nn.Parameter(base)
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * self.groups, bias=False)
        nn.init.zeros_(self.kernel_projection.weight)

    def dynamic(self, x_n: torch.Tensor) -> torch.Tensor:
        """The predicted kernel parts D [..., T, 2, Kc, G] of the normed input x_n [..., T, H]."""
        return self.kernel_projection(x_n).unflatten(-1, (2, self.kernel_size, self.groups))

    def forward(self, z: torch.Tensor, dynamic: torch.Tensor, side: int) -> torch.Tensor:
        """Conv_side(z) over the block axis (-2) of z [..., T, H]."""
        T = z.shape[-2]
        z = z.unflatten(-1, (self.groups, -1))  # [..., T, G, gs]: a dynamic weight per group
        out = torch.zeros_like(z)
        for o in range(min(self.kernel_size, T)):
            past = F.pad(z[..., :T - o, :, :], (0, 0, 0, 0, o, 0))  # z[t - o], zeros before the block
            w = self.base_kernel[side, o].view(self.groups, -1).to(z.dtype) + dynamic[..., side, o, :, None]
            out = out + w * past
        return out.flatten(-2)


class ConvLayer(nn.Module):
    """A DFlash decoder layer (blocks.Layer's parts, the published names) with a conv around each sub-layer."""

    def __init__(self, c: DFlash2Config):
        super().__init__()
        b = c.backbone
        self.input_layernorm = RMSNorm(b.hidden_size, b.rms_norm_eps)
        self.self_attn = Attention(b)
        self.post_attention_layernorm = RMSNorm(b.hidden_size, b.rms_norm_eps)
        self.mlp = MLP(b)
        self.attention_conv = GroupedDynamicConv(b.hidden_size, c.conv_kernel_size, c.conv_group_size)
        self.mlp_conv = GroupedDynamicConv(b.hidden_size, c.conv_kernel_size, c.conv_group_size)

    def forward(self, h, positions, ctx_k, ctx_v, mask, ctx_len=None):
        x = self.input_layernorm(h)
        d = self.attention_conv.dynamic(x)
        a = self.self_attn(self.attention_conv(x, d, 0), positions, ctx_k, ctx_v, mask, ctx_len)
        h = h + self.attention_conv(a, d, 1)
        x = self.post_attention_layernorm(h)
        d = self.mlp_conv.dynamic(x)
        return h + self.mlp_conv(self.mlp(self.mlp_conv(x, d, 0)), d, 1)


class CandidateSelector(nn.Module):
    """Rescoring of each slot's top-K tokens given the previous slot's token. The codebooks are plain [V, r]
    parameters (stored without `.weight`, as published); the successor one starts at 0: plain unary scores."""

    def __init__(self, vocab_size: int, hidden_size: int, rank: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.predecessor_codebook = nn.Parameter(0.02 * torch.randn(vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.zeros(vocab_size, rank))
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)

    def rescore(self, x: torch.Tensor, unary: torch.Tensor, cand: torch.Tensor, parents: torch.Tensor) -> torch.Tensor:
        """s(c | p) [..., P, K] = unary [..., K] + sum_r A[p]_r (P x)_r B[c]_r, for the candidates cand [..., K]
        given each of the parents [..., P], from the normed states x [..., H]."""
        a = F.embedding(parents, self.predecessor_codebook).float()  # [..., P, r]
        b = F.embedding(cand, self.successor_codebook).float()  # [..., K, r]
        ph = self.hidden_projection(x).float()  # [..., r]
        return unary.float()[..., None, :] + torch.einsum("...pr,...r,...kr->...pk", a, ph, b)

    def tables(self, x: torch.Tensor, logits: torch.Tensor, root: int) -> tuple[torch.Tensor, torch.Tensor]:
        """From the normed states x [D, H] and logits [D, V] of slots 1..D after the anchor `root`: candidates
        [D, K] (most likely first) and scores [D, K, K], s[d, j, k] = s_d(cand[d, k] | parent j), the parents
        being the previous slot's candidates (for d = 0 the anchor, the same in every row)."""
        unary, cand = logits.float().topk(min(self.top_k, logits.shape[-1]), dim=-1)
        parents = torch.cat([torch.full_like(cand[:1], root), cand[:-1]])  # [D, K]
        return cand, self.rescore(x, unary, cand, parents)


def walk(cand: torch.Tensor, scores: torch.Tensor, temperature: float = 0.0,
         generator: torch.Generator | None = None) -> tuple[list[int], list[int], torch.Tensor | None]:
    """The reference's chain through the tables: slot by slot, the previous choice picks the row. T = 0: the
    argmax; T > 0: a sample of q_d = softmax(s_d / T) over the K candidates. Returns the tokens [D], their
    indices among each slot's candidates [D] and, at T > 0, the q rows [D, K] they were drawn from."""
    row, tokens, picks, qs = 0, [], [], []
    for d in range(cand.shape[0]):
        s = scores[d, row]
        if temperature > 0:
            q = torch.softmax(s / temperature, dim=-1)
            pick = int(torch.multinomial(q, 1, generator=generator))
            qs.append(q)
        else:
            pick = int(s.argmax())
        tokens.append(int(cand[d, pick]))
        picks.append(pick)
        row = pick  # the next slot's row: this choice as its parent
    return tokens, picks, torch.stack(qs) if qs else None


class DFlash2Drafter(nn.Module):
    """The DFlash2 block drafter. Like DFlashDrafter, it uses the target's embedding and LM head (attached, not
    owned) and keeps only the context's injected K/V between rounds (a models.dflash.ContextCache)."""

    gradient_checkpointing = False  # as DFlashDrafter's (`hidden` is its)

    def __init__(self, config: DFlash2Config):
        super().__init__()
        self.dflash2 = config
        c = self.config = config.backbone  # what the shared pieces (Attention, ContextCache, BlockDrafter) read
        self.fc = nn.Linear(len(c.target_layer_ids) * c.hidden_size, c.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.layers = nn.ModuleList(ConvLayer(config) for _ in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.candidate_selector = CandidateSelector(c.vocab_size, c.hidden_size, config.selector_rank,
                                                    config.selector_top_k)
        for name, m in self.named_modules():
            if isinstance(m, nn.Linear) and not name.endswith("kernel_projection"):
                nn.init.normal_(m.weight, std=0.02)
        self._target = ()  # (embed, lm_head): a tuple, so that they are not registered (nor saved)
        self.ar_layer = None  # none: the borrowed DFlash forward asks
        self.compiled_block = None  # the borrowed draft_states asks: no compiled form (a scaled embedding)
        self.compiled_context = None  # (and the borrowed context_states)

    # ---- the target's modules: DFlashDrafter's (the same config fields and checks) -------------------------------
    attach = DFlashDrafter.attach
    embed = DFlashDrafter.embed
    lm_head = DFlashDrafter.lm_head

    # ---- forward pieces (DFlashDrafter's where the arithmetic is the same, see there) --------------------------
    fuse = DFlashDrafter.fuse
    block_tokens = DFlashDrafter.block_tokens
    context_kv = DFlashDrafter.context_kv
    context_states = DFlashDrafter.context_states
    forward = DFlashDrafter.forward  # training: the block states of many anchors over one sequence's context

    def block_inputs(self, first_tokens: torch.Tensor) -> torch.Tensor:
        """Embeddings [N * γ, H] of N blocks [token, mask x (γ-1)]: the target's raw embedding rows (as the
        reference: an embedding module that scales itself is bypassed) times input_embedding_scale."""
        return F.embedding(self.block_tokens(first_tokens), self.embed.weight).flatten(0, 1) \
            * self.dflash2.input_embedding_scale

    # the layers over the block, and the inference forward: DFlashDrafter's code over this model's layers
    hidden = DFlashDrafter.hidden
    draft_states = DFlashDrafter.draft_states  # no_grad already
    block_rows = DFlashDrafter.block_rows

    @torch.no_grad()
    def draft_states_batch(self, roots: list[int], contexts: list) -> torch.Tensor:
        """`draft_states` of B sequences in one forward [B, γ - 1, H] (each block sees its own, padded context):
        DFlashDrafter's code, which needs only block_inputs, config, fc and layers, run over this model's."""
        return DFlashDrafter.draft_states_batch(self, roots, contexts)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Final norm, the target's LM head, output_multiplier, then the soft cap: [..., V] (the unary scores)."""
        head = self.lm_head
        logits = F.linear(self.norm(h), head.weight.to(h.dtype), getattr(head, "bias", None))
        logits = logits * self.dflash2.output_multiplier
        cap = self.dflash2.final_logit_softcapping
        return torch.tanh(logits / cap) * cap if cap else logits

    @torch.no_grad()
    def selector_tables(self, root: int, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Candidates [γ-1, K] and conditional scores s_d(c | p) [γ-1, K, K] (CandidateSelector.tables) from the
        pre-norm states h [γ-1, H] of the block after `root`."""
        return self.candidate_selector.tables(self.norm(h), self.logits(h), root)

    @classmethod
    def from_dflash(cls, drafter: DFlashDrafter, **own) -> "DFlash2Drafter":
        """A DFlash2 drafter that starts as the DFlash drafter `drafter` (its backbone's weights; the convs the
        identity, the selector plain unary scoring); `own`: DFlash2Config's own fields (conv_kernel_size, ...).
        It scores the whole vocabulary, as the published format does (no FR-Spec rows)."""
        if drafter.ar_layer is not None or drafter.config.mask_token_id is None:
            raise DrafterError("a DFlash2 drafter starts from a plain DFlash drafter with a mask token (no AR layer)")
        backbone = replace(drafter.config, draft_vocab_size=None, ar_layer=None, extra={})
        model = cls(DFlash2Config(backbone, **own)).to(drafter.fc.weight.device)
        mine = model.state_dict()
        state = {k: v for k, v in drafter.state_dict().items() if k in mine}
        fresh = set(mine) - set(state)
        assert all(k.startswith("candidate_selector.") or "_conv." in k for k in fresh), sorted(fresh)[:4]
        model.load_state_dict(state, strict=False)
        if drafter._target:
            model._target = drafter._target
        return model

    # ---- save / load -------------------------------------------------------------------------------------------
    def save_pretrained(self, folder: str | Path, dtype: torch.dtype = torch.bfloat16) -> None:
        """config.json + model.safetensors in the published DFlash2 layout."""
        save_checkpoint(self.state_dict(), self.dflash2.to_json(), folder, dtype)

    @classmethod
    def from_pretrained(cls, folder: str | Path, dtype: torch.dtype = torch.float32) -> "DFlash2Drafter":
        folder = Path(folder)
        model = cls(parse_config(DFlash2Config.from_json, read_config(folder), folder))
        state = read_weights(folder)
        # the target's embedding / head, if stored, are not used; codebooks saved as nn.Embedding carry `.weight`
        state = {k.removesuffix(".weight") if k.removesuffix(".weight") in CODEBOOKS else k: v
                 for k, v in state.items() if not k.startswith(("embed_tokens.", "lm_head."))}
        load_strict(model, state, str(folder))
        return model.to(dtype).eval()


def is_dflash2(folder: str | Path) -> bool:
    """Whether the drafter folder holds a DFlash2 drafter (by its config's architectures)."""
    if not (Path(folder) / "config.json").is_file():
        return False
    return ARCHITECTURE in (read_config(folder).get("architectures") or [])  # unreadable: its one-line error
