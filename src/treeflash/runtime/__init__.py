"""The target runtime: loading a target (loading.py: Hub id, folder, GGUF; dtype, quantisation) and running it
(target.py) over one sequence's cache or a batch's: the HF reference (hf.py) and the static runtime (static.py,
static_decoder.py: preallocated KV slots; fused, packed or 4-bit products; compiled layers on a CPU, CUDA graphs on
a GPU)."""

from .loading import (COMPILE, DEFAULT_TARGET, DTYPES, EMBEDDED, HUB_IDS, QUANTIZE, RUNTIMES, TargetError, cache_dir,
                      default_device, embedded_gguf, gguf_file, hub_id, native_bf16, resolve, resolve_dtype)
from .output import TargetOutput
from .target import Target

__all__ = ["COMPILE", "DEFAULT_TARGET", "DTYPES", "EMBEDDED", "HUB_IDS", "QUANTIZE", "RUNTIMES", "Target",
           "TargetError", "TargetOutput", "cache_dir", "default_device", "embedded_gguf", "gguf_file", "hub_id",
           "native_bf16", "resolve", "resolve_dtype"]
