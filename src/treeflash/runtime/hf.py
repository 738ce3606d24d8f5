"""The reference runtime: the model's own Hugging Face forward over a `DynamicCache`, for every architecture.

Hybrid models (Qwen3.5, Qwen3-Next) also have Gated DeltaNet layers, which keep a conv and a recurrent state
instead of K/V. There every verification (chains too) runs those layers through the tree path of
`gdn.hybrid.HybridGDN`, which reads the committed states and writes nothing; `keep` writes the accepted path's.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
from transformers import DynamicCache

from ..gdn.hybrid import HybridGDN
from .output import TargetOutput
from .transfer import upload


class HFRuntime:
    name = "hf"
    decoder = None  # (the static runtime's; batches need it)

    def __init__(self, model):
        self.model = model
        self.cache: DynamicCache | None = None
        self.gdn = HybridGDN.install(model)  # None unless the model has Gated DeltaNet layers

    def start(self) -> None:
        """A new sequence: an empty cache (a hybrid's needs its layer types: linear-attention layers hold states)."""
        self.cache = DynamicCache(config=self.model.config) if self.gdn else DynamicCache()
        if self.gdn:
            self.gdn.discard()

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, length: int, allowed: torch.Tensor | None,
                taps: tuple[int, ...], last_only: bool, parents: tuple[int, ...] | None = None) -> TargetOutput:
        """ids, positions [n] after `length` cached positions; `allowed` [n, n] (None: causal); `parents`: the
        verified tree's, which GDN layers take their tree path over (HF's own multi-token path would write states
        that a rejection must undo); None in a prefill."""
        mask = None  # causal: let the model build its own mask
        if allowed is not None:
            visible = torch.cat([allowed.new_ones(len(ids), length), allowed], dim=1)
            dtype = self.model.dtype
            mask = torch.zeros(1, 1, *visible.shape, dtype=dtype, device=ids.device)
            mask.masked_fill_(~visible, torch.finfo(dtype).min)
        with self.gdn.tree(parents) if self.gdn and parents is not None else nullcontext():
            out = self.model(input_ids=ids[None], position_ids=positions[None], attention_mask=mask,
                             cache=self.cache, use_cache=True, output_hidden_states=bool(taps),
                             logits_to_keep=int(last_only))
        hidden = None
        if taps:  # hidden_states[i + 1] is the output of decoder layer i
            hidden = torch.stack([out.hidden_states[i + 1][0] for i in taps], dim=1)
        return TargetOutput(out.logits[0].float(), hidden)

    def _kv_layers(self) -> list:
        """The cache layers that hold keys and values (a hybrid's linear-attention layers hold states instead)."""
        return [layer for layer in self.cache.layers if getattr(layer, "keys", None) is not None]

    def _truncate(self, length: int) -> None:
        for layer in self._kv_layers():
            layer.keys = layer.keys[..., :length, :]
            layer.values = layer.values[..., :length, :]

    def keep(self, start: int, nodes: list[int]) -> None:
        """Keep the K/V (and a hybrid's states) of `nodes` of the tree verified after `start` positions."""
        k = len(nodes)
        if nodes != list(range(k)):
            index = upload(torch.tensor(nodes), self.model.device) + start
            for layer in self._kv_layers():
                # move the accepted entries down to start..start+k; the copy on the right is made before writing
                layer.keys[..., start:start + k, :] = layer.keys[..., index, :]
                layer.values[..., start:start + k, :] = layer.values[..., index, :]
        self._truncate(start + k)
        if self.gdn:  # linear-attention layers: the deferred commit of the accepted path's states
            self.gdn.commit(self.cache, nodes)

    def discard(self, length: int) -> None:
        """Forget everything past `length` (a verified tree that is not committed)."""
        self._truncate(length)
        if self.gdn:
            self.gdn.discard()

    # the reference is never compiled
    compiled = False

    def compile(self, mode: str, device: torch.device) -> None:
        if mode == "on":
            raise ValueError("the static runtime only")

    def eager(self):
        return nullcontext()
