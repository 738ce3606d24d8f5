"""CUDA graphs for the static decoder's verification forwards.

Eager, a GPU verification is bound by the host: an 8 B target launches ~1,400 kernels per forward, and the GPU
works 6.5 of the 34 ms a 1-token verification takes (docs/results/gpu). A CUDA graph replays them all in one launch,
but only in the shapes and at the addresses it was captured with. So the forward here runs in fixed shapes:

- the tokens of each sequence are padded to a bucket (1, 2, 3, 5, 9, 17, 33, ... 257: a root and 2^k drafts, so
  budgets 16 / 32 / 64 fill theirs);
- attention reads the whole cache (its capacity, which changes only when it grows) under a mask that the graph
  builds on the device from each sequence's start and its tree's ancestor mask;
- K/V are written by index (`cols`), and every input is a device tensor the round copies its values into.

One graph per (slots, batch, bucket, taps), kept on the cache it writes (`KVCache.graphs`, dropped when the cache
grows). `capture=False` runs the same fixed-shape code eagerly: the CPU tests' check of the bucket logic, against
`decoder_layer`'s own path.
"""

from __future__ import annotations

from bisect import bisect_left

import torch

from .transfer import upload

TOKEN_BUCKETS = (1, 2, 3, 5, 9, 17, 33, 65, 129, 257)


class CaptureError(RuntimeError):
    """A forward that CUDA could not capture as a graph (the decoder then goes on eager)."""


def bucket(n: int) -> int | None:
    """The bucket that n tokens per sequence pad to; None past the largest (those forwards stay eager)."""
    i = bisect_left(TOKEN_BUCKETS, n)
    return TOKEN_BUCKETS[i] if i < len(TOKEN_BUCKETS) else None


class FixedShapeForward:
    """B sequences x n tokens padded to bucket(n), in slots first_slot.. of a cache, with fixed-shape inputs."""

    def __init__(self, decoder, cache, first_slot: int, batch: int, tokens: int, taps: tuple[int, ...],
                 capture: bool):
        self.decoder, self.cache, self.taps, self.capture = decoder, cache, taps, capture
        device, capacity = decoder.device, cache.capacity
        self.slots = slice(first_slot, first_slot + batch)
        self.capacity = capacity
        self.cos, self.sin = decoder.cos, decoder.sin  # kept alive: the graph reads them at these addresses
        self.ids = torch.zeros(batch, tokens, dtype=torch.long, device=device)
        self.positions = torch.zeros(batch, tokens, dtype=torch.long, device=device)
        self.cols = torch.zeros(batch, tokens, dtype=torch.long, device=device)
        self.starts = torch.zeros(batch, dtype=torch.long, device=device)
        self.inner = torch.zeros(batch, tokens, tokens, dtype=torch.bool, device=device)
        self.graph = None  # captured at the first call, once the inputs hold real values

    def _body(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        from .static_decoder import _rms_norm, attention_mask, prologue

        d = self.decoder
        mask = attention_mask(self.starts, self.cols, self.inner, self.capacity, d.heads // d.kv_heads)
        # (its cache columns are `self.cols`, filled before the graph runs)
        x, cos, sin, _ = prologue(self.ids, self.positions, self.starts, self.cos, self.sin, d.embed.weight)
        x, hidden = d.layers_forward(x, cos, sin, self.cache, self.slots, self.capacity, None, self.cols, mask,
                                     self.taps)
        return d.lm_head(_rms_norm(x, d.final_norm)), hidden

    def _capture(self) -> None:
        """Capture the graph; its warm-up runs write K/V at this call's `cols`, past the committed positions."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up off the capturing stream, as torch.cuda.graph asks
            for _ in range(2):
                self._body()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(self.graph):
                self.out = self._body()
        except RuntimeError as err:  # an operation that cannot be captured
            self.graph = None
            raise CaptureError(str(err).splitlines()[0]) from err

    @torch.inference_mode()
    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, starts: list[int], allowed: torch.Tensor | None):
        """ids, positions [B, n] (n <= the bucket), `allowed` [B, n, n] (None: causal): logits [B, n, V] and taps
        [B, n, len(taps), H] or None, as `StaticDecoder.forward_batch` returns them."""
        B, n = ids.shape
        nb = self.ids.shape[1]
        # the values of this forward, into the fixed tensors (padding: token 0 at its sequence's start, seeing
        # itself only, its K/V written past the tree where nothing reads them)
        self.starts.copy_(upload(torch.tensor(starts), ids.device))
        self.cols.copy_(self.starts[:, None] + torch.arange(nb, device=ids.device))
        self.ids.zero_()
        self.ids[:, :n] = ids
        self.positions.copy_(self.starts[:, None].expand(B, nb))
        self.positions[:, :n] = positions
        self.inner.copy_(torch.eye(nb, dtype=torch.bool, device=ids.device).expand(B, nb, nb))
        self.inner[:, :n, :n] = allowed if allowed is not None else torch.ones(n, n, dtype=torch.bool,
                                                                               device=ids.device).tril()
        if not self.capture:
            logits, hidden = self._body()
        else:  # copies: the next replay overwrites the graph's outputs
            if self.graph is None:
                self._capture()
            self.graph.replay()
            logits, hidden = self.out
        return logits[:, :n].clone(), None if hidden is None else hidden[:, :n].clone()
