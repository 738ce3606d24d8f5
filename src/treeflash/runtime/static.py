"""The fast runtime of attention-only Llama-family targets: `StaticDecoder` (static_decoder.py) over one
sequence's slot, compiled where that pays (its layers built ahead of time by AOTInductor on a CPU, CUDA graphs of
the verification forwards on a GPU)."""

from __future__ import annotations

import logging
import os
import shutil
from contextlib import contextmanager

import torch

from ..models.checkpoint import error_line
from .loading import set_inductor_cache
from .output import TargetOutput
from .static_decoder import StaticDecoder

log = logging.getLogger(__name__)


class StaticRuntime:
    name = "static"

    def __init__(self, model):
        self.decoder = StaticDecoder(model)

    def start(self) -> None:
        pass  # a forward writes its tokens at their positions: what lies past a sequence's length is overwritten

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, length: int, allowed: torch.Tensor | None,
                taps: tuple[int, ...], last_only: bool, parents: tuple[int, ...] | None = None) -> TargetOutput:
        logits, hidden = self.decoder.forward(ids, positions, length, allowed, taps,
                                              slice(-1, None) if last_only else slice(None))
        return TargetOutput(logits.float(), hidden)

    def keep(self, start: int, nodes: list[int]) -> None:
        """Keep the K/V of `nodes` of the tree verified after `start` positions: one gather for all layers."""
        self.decoder.cache.keep(0, start, nodes)

    def discard(self, length: int) -> None:
        pass  # (as in `start`)

    @property
    def compiled(self) -> bool:
        return bool(self.decoder.compiled_layers) or self.decoder.graphs == "capture"

    def compile(self, mode: str, device: torch.device) -> None:
        """As Target.compile says; raises ValueError (why) where `on` cannot be honoured."""
        if mode == "on" and device.type == "cuda":
            self.decoder.use_graphs()
            return
        why = None
        if mode == "auto" and device.type != "cpu":
            # CUDA graphs are opt-in (`on`) until the GPU check has run them in the engine (docs/results/gpu)
            why = "auto compiles on the CPU only"
        elif shutil.which(os.environ.get("CXX", "g++")) is None and shutil.which("clang++") is None:
            why = "no C++ compiler (g++ or clang++) on the PATH"
        if why:
            if mode == "on":
                raise ValueError(why)
            return
        set_inductor_cache()
        try:
            self.decoder.compile()
        except ValueError:  # layers without a compiled form (dense products, q/k norms, ...)
            if mode == "on":
                raise
        except Exception as err:  # the toolchain failed (a compiler without Python's headers, ...): auto stays eager
            first = error_line(err)
            if mode == "on":
                raise ValueError(f"compiling the layer failed: {first}") from err
            log.warning("compile auto: compiling the layer failed, decoding eager: %s", first)

    @contextmanager
    def eager(self):
        """The eager layers for a while, compiled or not."""
        d = self.decoder
        rows, graphs = d.compiled_rows, d.graphs
        d.compiled_rows, d.graphs = 0, None
        try:
            yield
        finally:
            d.compiled_rows, d.graphs = rows, graphs
