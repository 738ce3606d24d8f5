"""Wall-clock time that waits for the accelerator, so that timings of asynchronous CUDA work are real."""

from __future__ import annotations

import time

import torch


def now(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def host() -> float:
    """The host's clock alone, for timings that end in a read of the accelerator's results (which waits anyway)."""
    return time.perf_counter()
