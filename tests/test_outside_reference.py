"""Every method against an outside reference: transformers' own greedy `generate` on a stock copy of SmolLM2 (fp32).

The other lossless tests compare a method with our `ar` through the same engine on the same target object, so a bug
shared by the engine and `ar` (a wrong position, a stale K/V entry, an off-by-one at EOS) would pass them all. Here
the reference is a model that treeflash never touched (no fused views, no packed weights, no static cache) decoded
by transformers; every method, single and batched, must give its tokens exactly."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from treeflash import generate
from treeflash.batching import BatchEngine
from treeflash.drafters import METHODS, make_drafter
from treeflash.runtime import resolve

STEPS = 128
PROMPTS = ("Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many "
           "clips did Natalia sell altogether in April and May?",
           "Write a Python function that checks whether a string is a palindrome, with a short docstring.",
           "What are three good habits for staying focused while working from home?")


@pytest.fixture(scope="module")
def reference(smollm2):
    """The prompts' ids and transformers' greedy continuations (EOS included where it comes, as ours)."""
    stock = AutoModelForCausalLM.from_pretrained(resolve("smollm2-135m-instruct"), dtype=torch.float32).eval()
    out = {}
    for text in PROMPTS:
        ids = smollm2.encode_prompt(text)
        with torch.no_grad():
            full = stock.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                  max_new_tokens=STEPS, do_sample=False, eos_token_id=sorted(smollm2.eos_ids),
                                  pad_token_id=sorted(smollm2.eos_ids)[0])
        out[text] = (ids, full[0, len(ids):].tolist())
    return out


@pytest.fixture(scope="module")
def dflash2_folder(tmp_path_factory):
    """No DFlash2 drafter ships: one made from the shipped DFlash drafter (from_dflash) with a random selector, so
    that the selector changes choices and the DFlash2 methods are not the DFlash ones under another name."""
    from treeflash.drafters.load import default_drafter_path
    from treeflash.models.dflash import DFlashDrafter
    from treeflash.models.dflash2 import DFlash2Drafter

    torch.manual_seed(0)
    model = DFlash2Drafter.from_dflash(DFlashDrafter.from_pretrained(default_drafter_path("smollm2-135m-instruct",
                                                                                          "dflash")),
                                       conv_kernel_size=2, conv_group_size=16, selector_rank=8, selector_top_k=8)
    with torch.no_grad():
        model.candidate_selector.successor_codebook.normal_(0, 0.5)
    folder = tmp_path_factory.mktemp("dflash2") / "drafter"
    model.save_pretrained(folder)
    return str(folder)


# no EAGLE-3 drafter ships: the one trained here that waits in data/stages (its card)
EAGLE3_FOLDER = str(Path(__file__).resolve().parent.parent / "data" / "stages" / "smollm2-135m-instruct-eagle3")


@pytest.mark.real
@pytest.mark.parametrize("method", METHODS)
def test_every_method_equals_transformers_generate(smollm2, reference, method, dflash2_folder):
    folder = dflash2_folder if method.startswith("dflash2") else EAGLE3_FOLDER if method == "eagle3" else None
    drafter = make_drafter(method, smollm2, folder)
    for ids, expected in reference.values():
        assert generate(smollm2, drafter, ids, STEPS, budget=16).tokens == expected, method


@pytest.mark.real
@pytest.mark.parametrize("method", ["pld", "ddtree", "tfm", "eagle3"])
def test_batched_methods_equal_transformers_generate(smollm2, reference, method):
    drafter = make_drafter(method, smollm2, EAGLE3_FOLDER if method == "eagle3" else None)
    engine = BatchEngine(smollm2, drafter, max_batch=2, budget=16)  # 3 prompts: one joins late
    results = engine.run([ids for ids, _ in reference.values()], STEPS)
    assert [r.tokens for r in results] == [expected for _, expected in reference.values()], method
