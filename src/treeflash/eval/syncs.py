"""Counting host synchronisations: how often the CPU waits for the accelerator.

Two kinds are counted: explicit `torch.cuda.synchronize` calls (the timing clock's), and the implicit ones that
CUDA's sync debug mode reports (`.item()`, `.tolist()`, device-to-host copies, `nonzero`). The first is counted
through a hook on `torch.cuda.synchronize`, the second from the warnings that mode raises, so the counting runs
(and is tested) on a CPU too, where nothing is ever reported.
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import torch

SYNC_WARNING = "synchronizing"  # in the text of the warning CUDA's sync debug mode raises at each implicit sync


@dataclass
class SyncCount:
    explicit: int = 0  # torch.cuda.synchronize calls
    implicit: int = 0  # syncs inside operations (item, tolist, device-to-host copies, ...)

    @property
    def total(self) -> int:
        return self.explicit + self.implicit


@contextmanager
def count_syncs() -> Iterator[SyncCount]:
    """Count the host synchronisations of the code inside (see the module docstring). The counts are complete once
    the block ends."""
    count = SyncCount()
    original = torch.cuda.synchronize

    def counted(*args, **kwargs):
        count.explicit += 1
        return original(*args, **kwargs)

    debug = torch.cuda.is_available()
    previous = torch.cuda.get_sync_debug_mode() if debug else 0
    torch.cuda.synchronize = counted
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if debug:
                torch.cuda.set_sync_debug_mode("warn")
            try:
                yield count
            finally:
                if debug:
                    torch.cuda.set_sync_debug_mode(previous)
        count.implicit = sum(SYNC_WARNING in str(w.message) for w in caught)
    finally:
        torch.cuda.synchronize = original
