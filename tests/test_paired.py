"""`paired`: the driver decodes exactly as `generate` would, the other variants' trees are scored and discarded."""

import random

import pytest
import torch

from treeflash import Sampling, generate
from treeflash.drafters import make_drafter
from treeflash.eval.paired import run_paired

from conftest import OracleTreeDrafter
from test_lossless import repetitive_prompt


def test_discard_forgets_the_tree(tiny):
    prompt = repetitive_prompt(random.Random(0), tiny.config.vocab_size)
    decoy = OracleTreeDrafter([], 0, tiny.config.vocab_size, seed=1).propose(prompt, None, 8)
    tree = OracleTreeDrafter([], 0, tiny.config.vocab_size, seed=2).propose(prompt, None, 8)
    tiny.prefill(prompt[:-1])
    fresh = tiny.verify(tree).logits
    tiny.prefill(prompt[:-1])
    tiny.verify(decoy)
    tiny.discard()
    torch.testing.assert_close(tiny.verify(tree).logits, fresh)


@pytest.mark.parametrize("sampling", [Sampling(), Sampling(temperature=1.0)])
def test_the_driver_decodes_as_generate(tiny, sampling):
    vocab = tiny.config.vocab_size
    prompts = [repetitive_prompt(random.Random(s), vocab) for s in range(2)]
    ar = [generate(tiny, make_drafter("ar"), p, 30).tokens for p in prompts]

    def oracle():  # trees that hold prompt 0's greedy continuation (decoys for prompt 1); its seed fixes them
        return OracleTreeDrafter(ar[0], len(prompts[0]), vocab, seed=3)

    driver = oracle()  # one object through both prompts, as in run_paired
    alone = [generate(tiny, driver, p, 30, sampling, budget=8, seed=5 + i) for i, p in enumerate(prompts)]
    drafters = {"oracle": (oracle(), 8), "pld": (make_drafter("pld"), 16), "ar": (make_drafter("ar"), 1)}
    report = run_paired(tiny, prompts, drafters, sampling, max_new_tokens=30, seed=5, progress=False)
    assert report["outputs"] == [r.tokens for r in alone]
    if sampling.greedy:
        assert report["outputs"] == ar  # lossless: the driver's tokens are greedy decoding's
    rounds = sum(len(r.rounds) for r in alone)
    assert report["rounds"] == rounds
    expected = sum(x.expected for r in alone for x in r.rounds) / rounds
    methods = report["methods"]
    assert methods["oracle"]["expected_tau"] == pytest.approx(expected)
    assert methods["oracle"]["ratio_to_first"] == 1.0
    assert methods["ar"]["expected_tau"] == 1.0  # a root-only tree commits the bonus token only
    assert report["prompt_rounds"] == [len(r.rounds) for r in alone]  # the per-prompt sums a bootstrap resamples
    assert methods["oracle"]["prompt_totals"] == pytest.approx([sum(x.expected for x in r.rounds) for r in alone])
    assert methods["ar"]["prompt_totals"] == report["prompt_rounds"]
