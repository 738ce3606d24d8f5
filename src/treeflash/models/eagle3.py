"""EAGLE-3 (Li et al. 2025), the sequential drafter the block drafters are measured against (issue 34).

One decoder layer whose input is [the token's embedding ; a state], both RMS-normed, with the state as the
residual. At the first step the state is `fc` (3H -> H) over three target taps of the position before the token
(a low, a middle and a high layer); at every later step it is the layer's own output at the parent. A final norm and
an LM head over a draft vocabulary (`d2t`: draft id -> target id offset; `t2d`: which target ids it holds) give the
next token. The layer attends to its K/V of the committed context and of the current path.

Tensor names and config fields follow SpecForge's `LlamaForCausalLMEagle3` (`fc`, `midlayer.*`, `norm`,
`lm_head`, `d2t`, `t2d`; `draft_vocab_size`, `eagle_config.eagle_aux_hidden_state_layer_ids`), so such
checkpoints load and ours load in SGLang and vLLM. The token embedding is the target's (attached, not saved).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from .blocks import RMSNorm, rope
from .checkpoint import (DrafterError, load_strict, misfits, parse_config, read_config, read_weights,
                         save_checkpoint)

ARCHITECTURE = "LlamaForCausalLMEagle3"


def eagle3_taps(num_target_layers: int) -> list[int]:
    """SGLang's and SpecForge's default taps: the outputs of layers 1, L / 2 - 1 and L - 4 (the inputs of layers
    2, L / 2 and L - 3), within 0..L-1 for very shallow targets."""
    return [min(max(i, 0), num_target_layers - 1) for i in (1, num_target_layers // 2 - 1, num_target_layers - 4)]


@dataclass
class Eagle3Config:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    draft_vocab_size: int
    target_layer_ids: list[int] | None  # None (a published config naming none): the engines' default, at attach
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1e6
    extra: dict = field(default_factory=dict)  # other fields of a published config, written back as they were

    @classmethod
    def for_target(cls, target_config, draft_vocab_size: int | None = None) -> "Eagle3Config":
        c = target_config
        heads = c.num_attention_heads
        rope_theta = (getattr(c, "rope_parameters", None) or {}).get("rope_theta", getattr(c, "rope_theta", 1e6))
        return cls(hidden_size=c.hidden_size, intermediate_size=c.intermediate_size, num_attention_heads=heads,
                   num_key_value_heads=getattr(c, "num_key_value_heads", heads),
                   head_dim=getattr(c, "head_dim", None) or c.hidden_size // heads, vocab_size=c.vocab_size,
                   draft_vocab_size=draft_vocab_size or c.vocab_size,
                   target_layer_ids=eagle3_taps(c.num_hidden_layers), rms_norm_eps=c.rms_norm_eps,
                   rope_theta=rope_theta)

    def to_json(self) -> dict:
        d = asdict(self)
        extra = d.pop("extra")
        taps = d.pop("target_layer_ids")
        eagle = {**extra.get("eagle_config", {}), "use_aux_hidden_state": True}
        if taps is not None:
            eagle["eagle_aux_hidden_state_layer_ids"] = taps
        return {**extra, "architectures": [ARCHITECTURE], "model_type": "llama", "num_hidden_layers": 1,
                "hidden_act": "silu", "tie_word_embeddings": False, **d, "eagle_config": eagle}

    @classmethod
    def from_json(cls, raw: dict) -> "Eagle3Config":
        raw = dict(raw)
        if raw.get("architectures") != [ARCHITECTURE]:
            raise ValueError(f"architectures {raw.get('architectures')}, not [{ARCHITECTURE!r}]")
        if raw.get("num_hidden_layers", 1) != 1:
            raise ValueError("an EAGLE-3 drafter has one decoder layer")
        taps = raw.get("eagle_config", {}).get("eagle_aux_hidden_state_layer_ids")
        heads = raw["num_attention_heads"]
        fields = dict(hidden_size=raw["hidden_size"], intermediate_size=raw["intermediate_size"],
                      num_attention_heads=heads, num_key_value_heads=raw.get("num_key_value_heads", heads),
                      head_dim=raw.get("head_dim") or raw["hidden_size"] // heads, vocab_size=raw["vocab_size"],
                      draft_vocab_size=raw.get("draft_vocab_size") or raw["vocab_size"],
                      target_layer_ids=None if taps is None else list(taps),
                      rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
                      rope_theta=(raw.get("rope_parameters") or {}).get("rope_theta", raw.get("rope_theta", 1e6)))
        known = set(fields) | {"architectures", "model_type", "num_hidden_layers", "hidden_act",
                               "tie_word_embeddings"}
        return cls(**fields, extra={k: v for k, v in raw.items() if k not in known})


class MidLayer(nn.Module):
    """The decoder layer over [embedding ; state] (SpecForge's `midlayer`): q, k and v read 2H inputs."""

    def __init__(self, c: Eagle3Config):
        super().__init__()
        self.c = c
        h, q, kv = c.hidden_size, c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
        self.input_layernorm = RMSNorm(h, c.rms_norm_eps)  # on the embedding
        self.hidden_norm = RMSNorm(h, c.rms_norm_eps)  # on the state
        self.post_attention_layernorm = RMSNorm(h, c.rms_norm_eps)
        self.self_attn = nn.Module()
        self.self_attn.q_proj = nn.Linear(2 * h, q, bias=False)
        self.self_attn.k_proj = nn.Linear(2 * h, kv, bias=False)
        self.self_attn.v_proj = nn.Linear(2 * h, kv, bias=False)
        self.self_attn.o_proj = nn.Linear(q, h, bias=False)
        self.mlp = nn.Module()
        self.mlp.gate_proj = nn.Linear(h, c.intermediate_size, bias=False)
        self.mlp.up_proj = nn.Linear(h, c.intermediate_size, bias=False)
        self.mlp.down_proj = nn.Linear(c.intermediate_size, h, bias=False)

    def qkv(self, emb: torch.Tensor, state: torch.Tensor, positions: torch.Tensor):
        """Queries [T, heads, d], keys and values [T, kv_heads, d] of T inputs at `positions` [T]."""
        c, a = self.c, self.self_attn
        x = torch.cat([self.input_layernorm(emb), self.hidden_norm(state)], dim=-1)
        q = rope(a.q_proj(x).unflatten(-1, (c.num_attention_heads, c.head_dim)), positions, c.rope_theta)
        k = rope(a.k_proj(x).unflatten(-1, (c.num_key_value_heads, c.head_dim)), positions, c.rope_theta)
        return q, k, a.v_proj(x).unflatten(-1, (c.num_key_value_heads, c.head_dim))

    def finish(self, state: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """The layer's output from its residual (the input state) and the attention's output [T, heads, d]."""
        h = state + self.self_attn.o_proj(attended.flatten(-2))
        m = self.mlp
        x = self.post_attention_layernorm(h)
        return h + m.down_proj(F.silu(m.gate_proj(x)) * m.up_proj(x))


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
           causal: bool = False) -> torch.Tensor:
    """q [T, heads, d] over k, v [M, kv_heads, d] (grouped-query), where mask [T, M] (None: all), or causally (T ==
    M: SDPA's fused kernel, where an explicit mask over a long prompt takes its quadratic math path) -> [T, heads,
    d]."""
    groups = q.shape[1] // k.shape[1]
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1).to(q.dtype),
                                         v.transpose(0, 1).to(q.dtype), attn_mask=mask, is_causal=causal,
                                         enable_gqa=groups > 1)
    return out.transpose(0, 1)


def attend_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """`attend` with a mask, for the few query rows of a drafting round over a long context: each KV head's query
    heads as the rows of one product, in fp32. SDPA's CPU kernels split the work by query blocks, so 1-8 rows keep
    one core busy (docs/results/eagle3: a round's cost)."""
    (T, heads, d), dtype = q.shape, q.dtype
    kv_heads = k.shape[1]
    groups = heads // kv_heads
    q = q.transpose(0, 1).reshape(kv_heads, groups * T, d).float()  # rows (query head in its group, position)
    scores = (q @ k.permute(1, 2, 0).float()) * d ** -0.5
    scores = scores.masked_fill(~mask.repeat(groups, 1), float("-inf"))
    out = scores.softmax(-1) @ v.transpose(0, 1).float()
    return out.reshape(heads, T, d).transpose(0, 1).to(dtype)


class Eagle3Drafter(nn.Module):
    """The EAGLE-3 model: `fuse` the target's taps, run `layer` over [embedding ; state], `scores` over the draft
    vocabulary (`vocab_ids` its target ids). Decoding is `drafters/eagle3.py`, training `train/eagle3.py`."""

    def __init__(self, config: Eagle3Config):
        super().__init__()
        c = self.config = config
        self.fc = nn.Linear(3 * c.hidden_size, c.hidden_size, bias=False)  # three taps
        self.midlayer = MidLayer(c)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.long))  # target id - draft id
        self.register_buffer("t2d", torch.ones(c.vocab_size, dtype=torch.bool))  # target ids in the draft vocab
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=0.02)
        self._embed: tuple = ()  # the target's embedding: a tuple, so that it is not registered (nor saved)

    # ---- vocabulary and the target's modules ------------------------------------------------------------------
    def attach(self, target_model) -> "Eagle3Drafter":
        """Use the target's token embedding; refuse a target this drafter does not fit."""
        c, tc = self.config, target_model.config.get_text_config(decoder=True)
        if c.target_layer_ids is None:  # the taps SGLang and vLLM take for a config that names none
            c.target_layer_ids = eagle3_taps(tc.num_hidden_layers)
        problems = misfits(c, tc)
        if len(c.target_layer_ids) != 3:
            problems.append(f"{len(c.target_layer_ids)} taps, not 3")
        if problems:
            raise DrafterError("this EAGLE-3 drafter does not fit the target: " + "; ".join(problems))
        self._embed = (target_model.get_input_embeddings(),)
        return self

    def use_vocab(self, token_ids: torch.Tensor, head_weight: torch.Tensor | None = None) -> "Eagle3Drafter":
        """Score these target tokens (sorted, draft_vocab_size of them): sets d2t / t2d, and the LM head's rows from
        `head_weight` [V, H] (the target's head) when given, a fresh drafter's start."""
        ids = token_ids.sort().values.to(self.d2t.device)
        if len(ids) != self.config.draft_vocab_size:
            raise ValueError(f"{len(ids)} token ids for a draft vocabulary of {self.config.draft_vocab_size}")
        self.d2t.copy_(ids - torch.arange(len(ids), device=ids.device))
        self.t2d.zero_()
        self.t2d[ids] = True
        if head_weight is not None:
            with torch.no_grad():
                self.lm_head.weight.copy_(head_weight.detach()[ids.to(head_weight.device)])
        return self

    @property
    def vocab_ids(self) -> torch.Tensor:
        """The target id of each draft id [draft_vocab]."""
        return self.d2t + torch.arange(len(self.d2t), device=self.d2t.device)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        if not self._embed:
            raise RuntimeError("attach(target_model) first: the drafter uses the target's embedding")
        return self._embed[0](tokens).to(self.fc.weight.dtype)

    # ---- forward pieces ---------------------------------------------------------------------------------------
    def fuse(self, taps: torch.Tensor) -> torch.Tensor:
        """First-step states [T, H] from the target's taps [T, 3, H]."""
        return self.fc(taps.flatten(-2).to(self.fc.weight.dtype))

    def scores(self, states: torch.Tensor) -> torch.Tensor:
        """Logits over the draft vocabulary [..., draft_vocab] of the layer's outputs [..., H]."""
        return self.lm_head(self.norm(states))

    # ---- save / load ------------------------------------------------------------------------------------------
    def save_pretrained(self, folder: str | Path, dtype: torch.dtype = torch.bfloat16) -> None:
        """config.json and model.safetensors: the weights in `dtype`, the maps as they are (int64, bool)."""
        save_checkpoint(self.state_dict(), self.config.to_json(), folder, dtype)

    @classmethod
    def from_pretrained(cls, folder: str | Path, dtype: torch.dtype = torch.float32) -> "Eagle3Drafter":
        raw = read_config(folder, "EAGLE-3 drafter")
        model = cls(parse_config(Eagle3Config.from_json, raw, folder))
        state = read_weights(folder)
        state.pop("embed_tokens.weight", None)  # some publish the target's embedding beside the drafter
        if "t2d" not in state:  # a drafter over the whole vocabulary
            state["t2d"], state["d2t"] = model.t2d, model.d2t
        load_strict(model, {k: v.bool() if k == "t2d" else v.long() if k == "d2t" else v for k, v in state.items()},
                    str(folder))
        return model.to(dtype).eval()  # (the maps stay int64 and bool: `to` casts floating tensors only)


def is_eagle3(folder: str | Path) -> bool:
    """Whether a folder holds an EAGLE-3 drafter (by its config's architecture)."""
    try:
        return read_config(folder).get("architectures") == [ARCHITECTURE]
    except (FileNotFoundError, DrafterError):
        return False
