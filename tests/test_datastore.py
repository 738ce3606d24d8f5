"""Retrieval drafting (method rest): the datastore's n-gram search against a plain scan, its files, the fallback
rule, and the command that builds one. Lossless tests: test_lossless.py (T = 0), test_exact_sequences.py (T > 0)
and, with the shipped datastore on the real model, test_outside_reference.py."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from treeflash.cli import main
from treeflash.drafters.datastore import FILE, Datastore
from treeflash.drafters.pld import PromptLookupDrafter
from treeflash.train.store import AnswerStore

from test_cli import tiny_folder  # noqa: F401 (a fixture)
from test_train import STORE_META


def plain_continuations(sequences, context, ngram, max_depth, min_ngram=1):
    """The longest n (from ngram down to min_ngram) whose last n context tokens occur in a sequence with at least
    one token after, and what follows every such occurrence (up to max_depth tokens, within its sequence): a scan of
    every position."""
    for n in range(min(ngram, len(context)), min_ngram - 1, -1):
        gram = context[-n:]
        paths = [seq[i + n:i + n + max_depth] for seq in sequences for i in range(len(seq) - n + 1)
                 if seq[i:i + n] == gram and i + n < len(seq)]
        if paths:
            return n, paths
    return 0, []


sequences = st.lists(st.lists(st.integers(0, 5), min_size=0, max_size=30), min_size=1, max_size=6)


@settings(max_examples=200, deadline=None)
@given(sequences, st.lists(st.integers(0, 5), min_size=1, max_size=6), st.integers(1, 6), st.integers(1, 3))
def test_continuations_equal_a_plain_scan(seqs, context, max_depth, min_ngram):
    datastore = Datastore.from_sequences(seqs, vocab_size=6)
    n, paths = datastore.continuations(context, max_depth, max_matches=10_000, min_ngram=min_ngram)
    want_n, want = plain_continuations(seqs, context, datastore.ngram, max_depth, min_ngram)
    assert n == want_n
    assert sorted(paths) == sorted(want)  # every occurrence once, none across two sequences


@settings(max_examples=50, deadline=None)
@given(sequences, st.lists(st.integers(0, 5), min_size=1, max_size=3), st.integers(1, 5))
def test_a_spread_of_many_matches_is_some_of_them(seqs, context, max_matches):
    datastore = Datastore.from_sequences(seqs, vocab_size=6)
    n, paths = datastore.continuations(context, 4, max_matches)
    _, every = datastore.continuations(context, 4, 10_000)
    assert len(paths) <= max_matches
    left = list(every)
    for path in paths:  # a sub-multiset of all the continuations (an occurrence is never taken twice)
        left.remove(path)


def test_files_round_trip_and_the_key_width_follows_the_vocabulary(tmp_path):
    seqs = [[1, 2, 3, 4, 5], [5, 4, 3], [49151, 7]]
    datastore = Datastore.from_sequences(seqs, vocab_size=49152)
    assert datastore.ngram == 4 and datastore.separator == 65535  # 16 bits a token: 4 tokens a key
    folder = datastore.save(tmp_path / "ds", {"note": "test"})
    with np.load(folder / FILE) as z:
        assert z["tokens"].dtype == np.uint16
    again = Datastore.load(folder)
    assert again.continuations([1, 2]) == datastore.continuations([1, 2]) == (2, [[3, 4, 5]])
    assert json.loads((folder / "datastore.json").read_text())["tokens"] == 10
    assert Datastore.from_sequences(seqs, vocab_size=151_936).ngram == 3  # Qwen's 18 bits: 3 tokens a key
    with pytest.raises(ValueError, match="token ids"):
        Datastore.from_sequences([[6]], vocab_size=6)
    with pytest.raises(FileNotFoundError, match="data datastore"):
        Datastore.load(tmp_path / "none")


def test_the_datastore_drafts_only_where_the_context_match_is_short():
    datastore = Datastore.from_sequences([[10, 11, 12, 13, 14]], vocab_size=20)
    rest, pld = PromptLookupDrafter(datastore=datastore), PromptLookupDrafter()
    assert rest.name == "rest" and pld.name == "pld"
    trusted = [1, 2, 3, 9, 1, 2, 3]  # "2, 3" repeats: the context's copy
    assert rest.propose(trusted, None, 4).tokens == pld.propose(trusted, None, 4).tokens == (3, 9, 1, 2, 3)
    alone = [5, 11, 12]  # nothing repeats in the context: the datastore's continuation
    assert rest.propose(alone, None, 3).tokens == (12, 13, 14)
    assert pld.propose(alone, None, 3).tokens == (12,)  # (a root alone: no draft)
    assert rest.propose([5, 12], None, 3).tokens == (12,)  # one token in common: too weak a match to draft from
    assert PromptLookupDrafter(datastore=datastore, datastore_min_ngram=1).propose([5, 12], None, 3).tokens == \
        (12, 13, 14)


def test_data_datastore_builds_one_that_bench_runs(tmp_path, tiny_folder):  # noqa: F811
    rng = random.Random(0)
    answers = [[rng.randrange(90) for _ in range(30)] for _ in range(4)]
    store = AnswerStore(tmp_path / "answers")
    store.append([f"gsm8k/{i}" for i in range(4)], [[1, 2, 3]] * 4, answers, {**STORE_META, "target": tiny_folder})
    out = tmp_path / "ds"
    assert main(["data", "datastore", "--data", str(store.folder), "--out", str(out), "--target", tiny_folder]) == 0
    info = json.loads((out / "datastore.json").read_text())
    assert info["answers_by_source"] == {"gsm8k": 4} and info["tokens"] == 120
    assert info["command"].startswith("treeflash data datastore")
    report = tmp_path / "bench.json"
    assert main(["bench", "--target", tiny_folder, "--dataset", "gsm8k", "--limit", "2", "--methods", "rest",
                 "--datastore", str(out), "--budget", "4", "--max-new-tokens", "12", "--dtype", "float32",
                 "--out", str(report), "--no-progress"]) == 0
    assert json.loads(report.read_text())["methods"]["rest"]["matches_ar"] is True
    # answers of another target: refused, as is a datastore of another vocabulary
    assert main(["data", "datastore", "--data", str(store.folder), "--out", str(tmp_path / "x"), "--target",
                 "smollm2-135m-instruct"]) == 2
    Datastore.from_sequences([[1, 2]], vocab_size=7).save(tmp_path / "other", {})
    assert main(["bench", "--target", tiny_folder, "--limit", "1", "--methods", "rest", "--datastore",
                 str(tmp_path / "other"), "--max-new-tokens", "4", "--dtype", "float32", "--no-progress"]) == 2
