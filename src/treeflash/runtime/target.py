"""A target: the model, its tokenizer, and one sequence's cache, verifying whole draft trees in one forward.

`prefill` starts a sequence, `verify` runs the flattened tree over the cache (ancestor mask, positions start +
depth) and leaves the tree's K/V pending, `commit` keeps the accepted nodes' K/V so that the cache equals what
sequential decoding would hold.

Two runtimes run the same model. Attention-only Llama-family models take the static runtime by default
(`static.py`: a preallocated KV cache, fused projections, SDPA, taps and LM head only where needed); the
generic HF forward over a `DynamicCache` (`hf.py`, `runtime="hf"`) is the reference, and the runtime of every
other architecture (hybrids with Gated DeltaNet layers included).
"""

from __future__ import annotations

import logging

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from ..tree import DraftTree
from . import int4
from .gguf_int4 import GGUFWeights, install as install_gguf
from .hf import HFRuntime
from .loading import (COMPILE, DEFAULT_TARGET, QUANTIZE, RUNTIMES, TargetError, default_device, gguf_file,
                      int4_cache_file, resolve, resolve_dtype, set_inductor_cache)
from .output import TargetOutput
from .static import StaticRuntime
from .static_decoder import StaticDecoder, unsupported_reason
from .transfer import upload

log = logging.getLogger(__name__)

# tokens per prefill forward: a long prompt runs in pieces, each over the cache the earlier ones wrote, so that its
# activations and attention mask stay bounded (a 32 K prompt in one forward: a 1 G-entry mask per layer)
PREFILL_CHUNK = 4096


def prefill_in_pieces(ids: list[int], forward, chunk: int = PREFILL_CHUNK) -> TargetOutput:
    """A prompt `chunk` tokens at a time: `forward(ids [n], positions [n], start)` runs one piece after the `start`
    positions before it and returns its TargetOutput (the last logits, every position's taps or None). Returns
    the last piece's logits and every position's taps."""
    pieces = []
    for start in range(0, len(ids), chunk):
        piece = ids[start:start + chunk]
        pieces.append(forward(torch.tensor(piece), torch.arange(start, start + len(piece)), start))
    hidden = None if pieces[0].hidden is None else torch.cat([p.hidden for p in pieces])
    return TargetOutput(pieces[-1].logits, hidden)


class Target:
    """`runtime`: "auto" (the static runtime where the architecture has one, else HF), "static" (refuse a model
    without one) or "hf" (the reference)."""

    def __init__(self, model, tokenizer=None, name: str = "model", runtime: str = "auto",
                 weights: GGUFWeights | str = "dense", compile: str = "off"):
        if runtime not in RUNTIMES:
            raise TargetError(f"unknown runtime {runtime!r}; choose one of {', '.join(RUNTIMES)}")
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.name = name
        self.taps: tuple[int, ...] = ()  # decoder layers whose outputs prefill and verify return (set by prefill)
        self.config = model.config.get_text_config(decoder=True)
        self.eos_ids = _eos_ids(model, tokenizer)
        self.length = 0  # committed positions in the cache
        self.pending = 0  # positions of the last verified tree, in the cache until commit()
        self.weights: GGUFWeights | str = weights
        reason = unsupported_reason(model)
        if runtime == "static" and reason:
            raise TargetError(f"no static runtime for {name}: {reason}; use runtime hf")
        self.backend = StaticRuntime(model) if runtime != "hf" and reason is None else HFRuntime(model)
        self.runtime = self.backend.name
        self.compile(compile)

    @property
    def static(self) -> StaticDecoder | None:
        """The static runtime's decoder (batches run on it), or None on the HF runtime."""
        return self.backend.decoder

    @property
    def compiled(self) -> bool:
        """Whether decoding runs compiled (`compile`): the static runtime's layers on a CPU, CUDA graphs on a GPU."""
        return self.backend.compiled

    @property
    def int4_products(self) -> bool:
        """Whether its linears multiply on the 4-bit kernel in bf16 (a GGUF's own tensors, or `quantize int4` on
        bf16): the fast path of a CPU, where its drafters' products go 4-bit too (`drafters.load`)."""
        if isinstance(self.weights, GGUFWeights):
            return bool(self.weights.quantised) and self.weights.kernel_dtype == "bfloat16"
        return self.weights.startswith("int4") and self.dtype == torch.bfloat16

    def compile(self, mode: str = "on") -> bool:
        """Compile the static runtime's decoding as `mode` asks (auto: where that is fast; on: refuse to stay
        eager; off: leave it as it is). On a CPU, its decoding layers through torch.compile
        (`StaticDecoder.compile`); on CUDA, with `on`, its verification forwards as CUDA graphs
        (`runtime/graphed.py`), captured at each shape's first use. Returns `compiled`."""
        if mode not in COMPILE:
            raise TargetError(f"unknown compile {mode!r}; choose one of {', '.join(COMPILE)}")
        if mode != "off":
            try:
                self.backend.compile(mode, self.device)
            except ValueError as err:
                raise TargetError(f"compile on: {err}") from err
        return self.compiled

    @classmethod
    def load(cls, name_or_path: str = DEFAULT_TARGET, dtype: str = "float32", device: str | None = None,
             runtime: str = "auto", quantize: str = "auto", compile: str = "off") -> "Target":
        """`dtype`: float32 (exact against plain decoding), bfloat16, or auto (bf16 where the hardware multiplies
        it natively, else fp32). `quantize`: for GGUF targets, auto keeps the file's 4-bit and 8-bit tensors and
        multiplies them with PyTorch's int4 CPU kernel where that is fast (CPU, bf16), gguf always, none never
        (the dequantised weights: the exact reference); for other targets, int4 rounds the linears to 4 bits
        (a different model: speculation stays exact with respect to it), auto and none leave them dense. Under
        dtype auto on a CPU without native bf16, a GGUF target's activations are fp32 and its 4-bit products
        multiply in bf16. `compile`: auto compiles the decoding layers where that is fast (a 4-bit target on the
        CPU; about 35 s at the first start on 2 cores, cached on disk after), on always (on a GPU: CUDA graphs of
        the verification forwards), off never (the eager reference)."""
        if quantize not in QUANTIZE:
            raise TargetError(f"unknown quantize {quantize!r}; choose one of {', '.join(QUANTIZE)}")
        if compile != "off":
            set_inductor_cache()  # before loading: inductor fixes its folder the first time anything asks for it
        device = default_device(device)
        torch_dtype = resolve_dtype(dtype, device)
        gguf = gguf_file(name_or_path)
        if quantize in ("gguf", "int4") and not int4.available(device):
            raise TargetError(f"quantize {quantize} runs PyTorch's int4 CPU kernel: it needs the CPU and torch >= 2.5")
        if quantize == "gguf" and gguf is None:
            raise TargetError("quantize gguf needs a GGUF target")
        if quantize == "int4" and gguf is not None:
            raise TargetError("a GGUF target is quantised already: use quantize gguf (or auto)")
        source = resolve(name_or_path)
        try:
            tokenizer = AutoTokenizer.from_pretrained(source)
            model = AutoModelForCausalLM.from_pretrained(source, dtype=torch_dtype).to(device)
        except OSError as err:
            raise TargetError(f"cannot load target {name_or_path!r}: {str(err).splitlines()[0]}") from None
        weights: GGUFWeights | str = "dense"
        # the kernel multiplies in bf16 where the activations are bf16, and under dtype auto on CPUs without
        # native bf16 too: there the activations stay fp32 and only the 4-bit products' inputs round to bf16,
        # about twice as fast as the dense fp32 weights (docs/results/cpu-int4-avx2)
        kernel = torch.bfloat16 if torch_dtype == torch.bfloat16 or dtype == "auto" else torch_dtype
        if gguf is not None and (quantize == "gguf" or (
                quantize == "auto" and kernel == torch.bfloat16 and int4.available(device))):
            weights = install_gguf(model, gguf, kernel, cache=int4_cache_file(gguf, kernel))
            log.info("%s: %s", gguf.name, weights)
        elif quantize == "int4":
            count = int4.quantise_model(model, torch_dtype)
            weights = f"int4, rounded to nearest in groups of {int4.GROUP}: {count} linears (LM head dense)"
        return cls(model, tokenizer, name=name_or_path, runtime=runtime, weights=weights, compile=compile)

    def eager(self):
        """Run the eager layers for a while, compiled or not (bench's `ar-eager`, tests): a context manager."""
        return self.backend.eager()

    # ---- properties -------------------------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    @property
    def context_length(self) -> int:
        return int(getattr(self.config, "max_position_embeddings", 1 << 30))

    @property
    def num_layers(self) -> int:
        return int(self.config.num_hidden_layers)

    # ---- text ----------------------------------------------------------------------------------------------------
    def encode_prompt(self, text: str, chat: bool = True) -> list[int]:
        """Token ids of a user prompt, wrapped in the chat template when the tokenizer has one."""
        return self.encode_chat([{"role": "user", "content": text}]) if chat else self.tokenizer(text).input_ids

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids of a conversation ({"role", "content"} dicts) in the chat template, ready for the assistant's
        reply; a tokenizer without a template gets the contents joined by newlines."""
        tok = self.tokenizer
        if getattr(tok, "chat_template", None):
            text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            return tok(text, add_special_tokens=False).input_ids
        return tok("\n".join(m["content"] for m in messages)).input_ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    # ---- forward passes ----------------------------------------------------------------------------------------
    @torch.inference_mode()
    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, allowed: torch.Tensor | None,
                 last_only: bool = False, parents: tuple[int, ...] | None = None) -> TargetOutput:
        """ids, positions [n] after the committed cache; `allowed` [n, n]: which of these tokens each one sees
        (None: causal). Logits at every position, or at the last only."""
        return self.backend.forward(upload(ids, self.device), upload(positions, self.device), self.length,
                                    allowed, self.taps, last_only, parents)

    def prefill(self, ids: list[int], taps: tuple[int, ...] = (), chunk: int = PREFILL_CHUNK) -> TargetOutput:
        """Start a new sequence. Returns the logits of the last position and, at every position, the outputs of
        the decoder layers `taps` (which every later `verify` of this sequence returns too). The prompt runs
        `chunk` tokens at a time."""
        if not ids:
            raise ValueError("empty prompt")
        if len(ids) >= self.context_length:
            raise ValueError(f"prompt has {len(ids)} tokens; the target's context is {self.context_length}")
        self.taps = tuple(taps)
        self.backend.start()
        self.pending = 0

        def piece(piece_ids: torch.Tensor, positions: torch.Tensor, start: int) -> TargetOutput:
            self.length = start
            return self._forward(piece_ids, positions, None, last_only=True)
        out = prefill_in_pieces(ids, piece, chunk)
        self.length = len(ids)
        return out

    def verify(self, tree: DraftTree) -> TargetOutput:
        """One forward over the flattened tree. The tree's K/V stay pending until `commit`."""
        if self.pending:
            raise RuntimeError("commit() the previous tree before verifying another")
        allowed = None if tree.is_chain else upload(tree.ancestor_mask(), self.device)  # a chain is causal
        out = self._forward(torch.tensor(tree.tokens), tree.positions(self.length), allowed, parents=tree.parents)
        self.pending = len(tree)
        return out

    def discard(self) -> None:
        """Forget the last verified tree (none of its K/V, nor any recurrent state, is kept)."""
        self.backend.discard(self.length)
        self.pending = 0

    @torch.inference_mode()
    def commit(self, nodes: list[int]) -> None:
        """Keep the K/V of `nodes` (indices into the last verified tree, root first, a root-to-node path)."""
        self.backend.keep(self.length, nodes)
        self.length, self.pending = self.length + len(nodes), 0


def _eos_ids(model, tokenizer) -> frozenset[int]:
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config, tokenizer):
        value = getattr(source, "eos_token_id", None)
        if value is not None:
            ids.update(value if isinstance(value, (list, tuple)) else [value])
    return frozenset(int(i) for i in ids)
