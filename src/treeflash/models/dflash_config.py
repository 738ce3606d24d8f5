"""DFlash's config: the published layout (Qwen3 fields plus `dflash_config`; TreeFlash's `treeflash_config`),
read and written, and the choices it records (the target layers tapped, the mask token)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from .checkpoint import DrafterError


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
    # trained on blocks cut to random lengths (`train dflash --short-blocks`): at inference a block of B + 1
    # positions serves a tree B deep, instead of γ positions of which the tree reads B + 1
    short_blocks: bool = False
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
