"""The layout of 4-bit products by row count (`runtime/crossover.py`): the rule picks the first row count where the
dense copy is faster by its margin, the measurement runs once per machine and is read back from the cache, and a
compiled 4-bit target takes its head's and its layers' dense copies from the measured rows on (their logits:
`test_compiled.py`)."""

import pytest
import torch

from treeflash import Target
from treeflash.runtime import crossover
from treeflash.runtime.int4 import quantise_linears
from treeflash.runtime.static_decoder import COMPILED_ROWS, DENSE_COMPILED_ROWS, DENSE_ROWS

from conftest import tiny_target
from test_compiled import needs_compiler
from test_int4 import WIDE

MAX_ROWS = 6


@pytest.mark.parametrize("dense_faster_from, expected", [(1, 1), (3, 3), (None, MAX_ROWS)])
def test_the_dense_copy_is_taken_from_the_first_row_count_where_it_is_faster(dense_faster_from, expected):
    kernel = lambda rows: 1.0 + rows  # noqa: E731
    dense = lambda rows: 10.0 if dense_faster_from is None or rows < dense_faster_from else 0.5 + rows  # noqa: E731
    assert crossover.first_faster(kernel, dense, MAX_ROWS) == expected


def test_a_near_tie_keeps_the_kernel():
    ms = 1.0
    assert crossover.first_faster(lambda rows: ms, lambda rows: (1 - crossover.MARGIN / 2) * ms, MAX_ROWS) == MAX_ROWS


def test_the_crossover_is_measured_once_then_read_from_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TREEFLASH_CACHE", str(tmp_path))
    calls = []

    def products(rows):
        x = torch.randn(rows, 32)
        return lambda: calls.append(rows) or x, lambda: x

    args = ("head", products, MAX_ROWS, lambda: None, ("shapes",))
    first = crossover.dense_rows(*args)
    assert 1 <= first <= MAX_ROWS and calls
    timed = len(calls)
    assert crossover.dense_rows(*args) == first and len(calls) == timed  # read back: nothing timed again
    assert list(tmp_path.glob("crossover/head-*.json"))


@needs_compiler
def test_a_compiled_target_with_a_4bit_head_measures_it(tmp_path, monkeypatch):
    monkeypatch.setattr(crossover, "cache_dir", lambda: tmp_path)  # a fresh measurement; the packages as cached
    seen = []
    monkeypatch.setattr(crossover, "first_faster", lambda kernel, dense, max_rows: seen.append(
        (kernel(1), dense(1), max_rows)) or 2)
    model = tiny_target("llama", runtime="hf", **WIDE).model
    assert isinstance(model.lm_head, torch.nn.Linear)
    quantise_linears(model, torch.float32)  # the LM head too
    target = Target(model, weights="int4")
    head = target.static.lm_head
    assert head.int4 is not None and head.dense_rows == DENSE_ROWS[torch.float32]  # eager: the fixed rule
    assert target.compile("on")
    assert head.dense_rows == 2 and (DENSE_ROWS[torch.float32]) in [max_rows for *_, max_rows in seen]
    # the layers' crossover too: the 4-bit kernel below it, the dense copies' compiled layer from it on
    assert (COMPILED_ROWS + 1) in [max_rows for *_, max_rows in seen]
    assert target.static.int4_rows == 1 and target.static.compiled_rows == DENSE_COMPILED_ROWS
