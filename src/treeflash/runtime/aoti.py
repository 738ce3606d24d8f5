"""Graphs compiled ahead of time: `torch.export` then AOTInductor, one package per graph and machine, cached on disk.

A package's runner costs almost nothing above its kernels, where a `torch.compile` call pays dynamo's guards and
AOTAutograd's wrappers (~25 us a call, 0.1-0.2 ms with a drafter's 40 weight tensors and the caches cold after a
target step). So the forwards called every step or round run as packages: the target's decoder layer
(`compiled_layer.py`) and the DFlash drafter's block and catch-up (`models/compiled_block.py`). The first start
builds them (seconds each), later starts load them in milliseconds. A package's key holds the source of the module
that builds it, so an upgrade builds new ones: a package unused for `STALE_DAYS` is deleted when one of its name is
built.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
import time
import warnings
from typing import Callable

import torch

from .loading import cache_dir

log = logging.getLogger(__name__)

STALE_DAYS = 30  # a package unused this long is deleted when another of its name is built
DIGEST = 16  # hex digits of the key's sha256 in a package's file name, `name-digest.pt2`


def package(name: str, key: tuple, export: Callable[[], torch.export.ExportedProgram],
            inductor: dict | None = None) -> Callable[..., list[torch.Tensor]]:
    """The runner of the package `name` whose graph and shapes `key` identifies, built first by compiling
    `export()` (with these inductor options) where this machine has none yet. The key is completed with what
    the built code depends on besides: the torch version, the CPU's vector ISA and the thread count (inductor
    splits loops for that many). Called as run(*tensors) -> the graph's outputs."""
    key = (torch.__version__, torch.backends.cpu.get_cpu_capability(), torch.get_num_threads()) + key
    path = cache_dir() / "aoti" / f"{name}-{hashlib.sha256(repr(key).encode()).hexdigest()[:DIGEST]}.pt2"
    with warnings.catch_warnings():  # torch's own deprecations inside export and the package loader
        warnings.simplefilter("ignore", FutureWarning)
        if not path.exists():
            from torch import _inductor  # (imported only to build: 1-2 s of a start on 2 cores)

            # shown by the command line (as the GGUF's dequantising): a first start is silent for a minute otherwise
            log.warning("compiling %s ahead of time, once per model and machine (10-30 s on 2 cores): %s", name, path)
            program = export()
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(suffix=".pt2", dir=path.parent)
            os.close(fd)
            try:  # written whole, then renamed: two processes building at once leave one complete package
                with _inductor.config.patch(inductor or {}):
                    _inductor.aoti_compile_and_package(program, package_path=tmp)
                os.replace(tmp, path)
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
            prune(path.parent, name)
        _touch(path)  # its modification time says when it was last used
        run = load(path)
    return lambda *args: run(list(args))


def load(path) -> Callable[[list[torch.Tensor]], list[torch.Tensor]]:
    """A package's runner, from torch's C++ loader, as `torch._inductor.aoti_load_package` makes it: that
    function first reads the archive in Python (1.6 s of a cached start on 2 cores), and its package's __call__
    re-reads the input spec on every call (~15 us)."""
    return torch._C._aoti.AOTIModelPackageLoader(str(path), "model", False, 1, -1).run


def prune(folder, name: str, days: float = STALE_DAYS) -> list[str]:
    """Delete the packages `name-digest.pt2` in `folder` unused for `days` (those of older treeflash or torch
    versions, other thread counts, models no longer run); returns the names deleted. The digest is matched exactly,
    so that no other name's packages match (`drafter` would otherwise take `drafter-block`'s)."""
    deleted, before = [], time.time() - days * 86400
    for old in folder.glob(f"{name}-{'[0-9a-f]' * DIGEST}.pt2"):
        try:
            if old.stat().st_mtime < before:
                old.unlink()
                deleted.append(old.name)
        except OSError:  # another process deleted it, or a read-only cache
            pass
    if deleted:
        log.info("deleted %d %s package(s) unused for %g days from %s", len(deleted), name, days, folder)
    return deleted


def _touch(path) -> None:
    try:
        os.utime(path)
    except OSError:  # a read-only cache: packages are then never pruned
        pass


def shapes(tensors: tuple[torch.Tensor, ...]) -> list[tuple]:
    """What a package's key says of the tensors passed in (their values are not in the package)."""
    return [(tuple(t.shape), str(t.dtype)) for t in tensors]


def export_sized(module: torch.nn.Module, args: tuple, dims: tuple) -> torch.export.ExportedProgram:
    """`torch.export` of module(*args) with symbolic sizes `dims`, from 0 up: without `backed_size_oblivious`,
    export assumes every symbolic size is at least 2 (and a size of 1 would need a graph of its own)."""
    with torch.fx.experimental._config.patch(backed_size_oblivious=True), torch.no_grad():
        return torch.export.export(module, args, dynamic_shapes=dims, strict=False)
