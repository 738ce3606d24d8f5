"""The GPU check's logic on the CPU: every step of scripts/gpu_check.py at toy sizes, host-sync counting through
its hook, and the defaults by device."""

from __future__ import annotations

import importlib.util
import json
import warnings
from pathlib import Path

import pytest
import torch

from treeflash.clock import now
from treeflash.engine import DEFAULT_MAX_BUDGET, GPU_MAX_BUDGET, default_max_budget
from treeflash.eval.syncs import count_syncs

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "gpu_check.py"


@pytest.fixture(scope="module")
def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def reports(gpu_check, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("gpu_check")
    codes = {step: gpu_check.main([step, "--small", "--device", "cpu", "--out", str(out)])
             for step in ("versions", "correctness", "speed", "train")}
    assert codes == dict.fromkeys(codes, 0)
    return {step: json.loads((out / f"{step}.json").read_text()) for step in codes}


def test_correctness_step_holds_every_method_to_ar(reports):
    """Eager, and with the verification forwards in the fixed shapes of CUDA graphs (run eagerly on a CPU)."""
    r = reports["correctness"]
    assert r["ok"] and r["ar_equals_transformers_generate"]
    assert r["trees_max_abs_diff"] < r["tolerance"] and r["uneven_batch_max_abs_diff"] < r["tolerance"]
    for methods in (r["methods"], r["methods_graphs"]):
        assert set(methods) == {"ar", "pld", "dflash", "ddtree", "treeflash", "tfm", "dflash2", "dflash2-tree"}
        assert all(m["single_equal"] and all(m["batched_equal"]) for m in methods.values())


def test_speed_and_train_steps_report_what_they_name(reports):
    eager = reports["speed"]["eager"]
    assert set(eager["verify"]) == {"1", "17", "65", "257"} and reports["speed"]["prefill"]["tokens_per_s"] > 0
    assert set(eager["rounds"]) == {"ar", "ddtree@16", "ddtree@64"} and set(eager["batches"]) == {"8", "32"}
    assert "graphs" not in reports["speed"]  # CUDA only
    assert reports["train"]["seconds_per_step"] > 0 and reports["train"]["loss"] > 0


def test_count_syncs_counts_explicit_and_reported_syncs(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: calls.append(a))  # no CUDA here: a stand-in
    with count_syncs() as syncs:
        now(torch.device("cuda"))  # the clock's explicit sync, through the hook
        now(torch.device("cpu"))  # none
        warnings.warn("called a synchronizing CUDA operation")  # what CUDA's sync debug mode raises
        warnings.warn("something else")
    assert (syncs.explicit, syncs.implicit, syncs.total) == (1, 1, 2) and len(calls) == 1
    now(torch.device("cuda"))
    assert syncs.explicit == 1  # the hook is gone


def test_defaults_by_device():
    assert default_max_budget("cpu") == DEFAULT_MAX_BUDGET == 16
    assert default_max_budget(torch.device("cuda")) == GPU_MAX_BUDGET > DEFAULT_MAX_BUDGET
