"""From how many rows a 4-bit product is faster on its dense copy: measured once per machine and cached on disk.

A GGUF's 4-bit tensors multiply on PyTorch's int4 kernel, whose compute grows with the rows; the static runtime
keeps a packed dense copy of each and takes it from `static_decoder.DENSE_ROWS` rows on, a fixed rule. The LM head
is where machines disagree most. SmolLM2's head is Q8_0, two 4-bit halves: twice the kernel's work for the bytes of
one dense bf16 copy. After a step's layers have streamed through the caches, its product at one row took 1.9-2.0 ms
on the kernel and 1.37 ms on the dense copy on an Intel Xeon with AMX (docs/results/cpu-amx), while on an AMD
EPYC the kernel was the faster at one row. So the compiled runtime measures the head's crossover at load (0.1-0.5
s, once per machine: the result is cached beside the compiled packages) and keeps the fixed rule as the
eager reference. The dense copy holds the same weights, rounded to the activations' dtype: a near-tie can round
otherwise there, as on every dense product.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import statistics
import tempfile
import time
from typing import Callable

import torch

from .loading import cache_dir

log = logging.getLogger(__name__)

REPEATS = 7  # timings of each layout per row count, alternating
MARGIN = 0.05  # the dense copy must be this much faster: near a tie the kernel stays (it reads fewer bytes)


def first_faster(kernel_ms: Callable[[int], float], dense_ms: Callable[[int], float], max_rows: int) -> int:
    """The fewest rows, 1..max_rows, at which the dense copy beats the kernel by MARGIN; max_rows where it never
    does (the fixed rule's own crossover)."""
    for rows in range(1, max_rows):
        if dense_ms(rows) < (1 - MARGIN) * kernel_ms(rows):
            return rows
    return max_rows


def timed_ms(products: tuple[Callable[[], object], ...], flush: Callable[[], object],
             repeats: int = REPEATS) -> list[float]:
    """Median milliseconds of each product, each run after `flush()` (what comes before it in a step), the
    products alternating so that a drift of the machine's speed hits them alike."""
    times: list[list[float]] = [[] for _ in products]
    for _ in range(repeats):
        for i, product in enumerate(products):
            flush()
            start = time.perf_counter()
            product()
            times[i].append(time.perf_counter() - start)
    return [1e3 * statistics.median(t) for t in times]


def machine() -> str:
    """What the measurement depends on besides the weights: the CPU, its vector ISA, the threads, torch."""
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    return f"{cpu}|{torch.backends.cpu.get_cpu_capability()}|{torch.get_num_threads()}|{torch.__version__}"


@torch.inference_mode()
def dense_rows(name: str, products: Callable[[int], tuple[Callable[[], object], Callable[[], object]]],
               max_rows: int, flush: Callable[[], object], key: tuple) -> int:
    """The rows from which the product(s) `name` (identified with its weights' shapes by `key`) run on their dense
    copy: `first_faster` of the two layouts, timed on this machine the first time, then read from the cache.
    products(rows) gives the kernel's and the dense copy's runs at that many rows, their inputs made."""
    digest = hashlib.sha256(repr((machine(), max_rows, MARGIN) + key).encode()).hexdigest()[:16]
    path = cache_dir() / "crossover" / f"{name}-{digest}.json"
    try:
        return int(json.loads(path.read_text())["dense_rows"])
    except (OSError, ValueError, KeyError):
        pass
    measured: dict[int, list[float]] = {}

    def ms(rows: int) -> list[float]:
        if rows not in measured:
            measured[rows] = timed_ms(products(rows), flush)
        return measured[rows]
    rows = first_faster(lambda n: ms(n)[0], lambda n: ms(n)[1], max_rows)
    log.info("%s: the dense copy from %d rows on (kernel / dense ms by rows: %s)", name, rows, measured)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".json", dir=path.parent)
    with os.fdopen(fd, "w") as f:
        json.dump({"dense_rows": rows, "ms": measured, "machine": machine()}, f)
    os.replace(tmp, path)
    return rows
