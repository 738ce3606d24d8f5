"""Shared fixtures: tiny random targets for logic, the real SmolLM2 target for a few end-to-end checks."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from treeflash import DraftTree, Target

TINY = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, bos_token_id=None, eos_token_id=None,
            pad_token_id=None)


def tiny_target(kind: str, seed: int = 0, runtime: str = "auto", logit_scale: float = 1.0, **overrides) -> Target:
    """A tiny random Llama or Qwen3 target; `runtime` "auto" takes the static fast path, "hf" the reference;
    `logit_scale` sharpens its distributions. (The fast path packs the weights when the Target is built: change
    them before, not after.)"""
    torch.manual_seed(seed)
    if kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(**{**TINY, **overrides}))
    elif kind == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**{**TINY, "head_dim": 16, **overrides}))
    else:
        raise ValueError(kind)
    with torch.no_grad():
        model.lm_head.weight.mul_(logit_scale)
    return Target(model.float(), name=f"tiny-{kind}", runtime=runtime)


@pytest.fixture(scope="session", params=["llama", "qwen3", "llama/hf"])
def tiny(request) -> Target:
    """Both architectures on the fast path, and the HF reference runtime."""
    kind, _, runtime = request.param.partition("/")
    return tiny_target(kind, runtime=runtime or "auto")


@pytest.fixture(scope="session")
def smollm2() -> Target:
    return Target.load("smollm2-135m-instruct", dtype="float32")


class OracleTreeDrafter:
    """Test drafter: random trees that contain a (randomly cut, sometimes wrong) piece of the true continuation.

    A random decoy branch comes before the true one, so the accepted path is rarely a prefix of the node
    order: that exercises acceptance deep in a tree and the K/V compaction of scattered nodes.
    """

    name, taps, drafts = "oracle-tree", (), True
    forward_s, adapter_calls = 0.0, 0

    def __init__(self, reference: list[int], prompt_len: int, vocab: int, seed: int = 0):
        self.reference, self.prompt_len, self.vocab = reference, prompt_len, vocab
        self.rng = random.Random(seed)

    def reset(self) -> None:
        pass

    def follow(self, sampling, generator=None) -> None:
        pass

    def propose(self, tokens, features, budget) -> DraftTree:
        rng, done = self.rng, len(tokens) - self.prompt_len
        truth = list(self.reference[done:done + rng.randint(0, 12)])
        if truth and rng.random() < 0.3:  # a wrong token somewhere on the true branch
            truth[rng.randrange(len(truth))] = rng.randrange(self.vocab)
        decoys = [[rng.randrange(self.vocab) for _ in range(rng.randint(1, 4))] for _ in range(rng.randint(0, 4))]
        # a decoy that shares the true branch's first tokens makes the accepted path fork away from node order
        if truth:
            decoys.append(truth[: rng.randint(1, len(truth))] + [rng.randrange(self.vocab)])
        return DraftTree.from_paths(tokens[-1], decoys[:1] + [truth] + decoys[1:], budget=budget)
