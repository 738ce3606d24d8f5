"""Other engines on the same prompts, for `bench`: what a user would run instead of treeflash.

- `hf`: transformers' own `generate` on the target's model, with the same sampling;
- `hf-pld`: the same with transformers' prompt lookup decoding (`prompt_lookup_num_tokens`);
- `llamacpp`: plain decoding of the target's GGUF file through llama-cpp-python (an optional extra: PyPI ships
  only its source). It computes on the quantised weights, so its tokens may differ from the target's.

Each returns the new tokens, the seconds they took and the number of target forwards (τ = tokens / forwards).
"""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path

import torch

from ..clock import now
from ..target import EMBEDDED, Target, embedded_gguf, resolve
from ..verify import Sampling

BASELINES = ("hf", "hf-pld", "llamacpp")
PLD_TOKENS = 10  # transformers' documented example value


class BaselineUnavailable(RuntimeError):
    """A baseline that cannot run here (reported as skipped, never as a crash)."""


def gguf_file(target: Target) -> Path:
    if target.name in EMBEDDED:
        return embedded_gguf(target.name)
    if target.name.endswith(".gguf"):
        return Path(target.name)
    raise BaselineUnavailable(f"llamacpp needs a GGUF target (got {target.name})")


def stock_model(target: Target):
    """The target's model as transformers loads it, untouched by the fast runtime (which re-lays its weights out)."""
    from transformers import AutoModelForCausalLM

    if target.name in EMBEDDED or Path(target.name).exists() or "/" in target.name:
        model = AutoModelForCausalLM.from_pretrained(resolve(target.name), dtype=target.dtype)
        return model.to(target.device).eval()
    return target.model  # built in memory (tests): nothing to reload


class HFGenerate:
    """transformers' generate on a stock copy of the target's model (with `prompt_lookup` tokens: prompt lookup
    decoding). The copy shares no memory with the target."""

    def __init__(self, target: Target, model, prompt_lookup: int = 0):
        self.target, self.model, self.prompt_lookup = target, model, prompt_lookup

    def __call__(self, prompt: list[int], max_new_tokens: int, sampling: Sampling, seed: int):
        target, forwards = self.target, 0

        def count(*_):
            nonlocal forwards
            forwards += 1

        torch.manual_seed(seed)
        kwargs = dict(do_sample=False) if sampling.greedy else dict(
            do_sample=True, temperature=sampling.temperature, top_k=sampling.top_k or None, top_p=sampling.top_p)
        if self.prompt_lookup:
            kwargs["prompt_lookup_num_tokens"] = self.prompt_lookup
        hook = self.model.register_forward_pre_hook(count)
        try:
            start = now(target.device)
            with torch.inference_mode():
                out = self.model.generate(
                    torch.tensor([prompt], device=target.device), max_new_tokens=max_new_tokens,
                    eos_token_id=sorted(target.eos_ids) or None, pad_token_id=next(iter(target.eos_ids), 0),
                    attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=target.device), **kwargs)
            seconds = now(target.device) - start
        finally:
            hook.remove()
        return out[0, len(prompt):].tolist(), seconds, max(forwards - 1, 1)  # the prefill is not a decode round


class LlamaCpp:
    """llama.cpp's plain decoding of the target's GGUF, with as many threads as torch uses."""

    def __init__(self, target: Target):
        if importlib.util.find_spec("llama_cpp") is None:
            raise BaselineUnavailable("llama-cpp-python is not installed (pip install llama-cpp-python: a source "
                                      "build of about 15 minutes)")
        from llama_cpp import Llama

        self.eos = target.eos_ids
        self.llm = Llama(model_path=str(gguf_file(target)), n_ctx=min(target.context_length, 4096),
                         n_threads=torch.get_num_threads(), verbose=False)

    def __call__(self, prompt: list[int], max_new_tokens: int, sampling: Sampling, seed: int):
        self.llm.reset()
        self.llm.set_seed(seed)
        tokens = []
        start = time.perf_counter()
        for token in self.llm.generate(prompt, temp=sampling.temperature, top_k=sampling.top_k,
                                       top_p=sampling.top_p, reset=True):
            tokens.append(token)
            if len(tokens) == max_new_tokens or token in self.eos:
                break
        return tokens, time.perf_counter() - start, max(len(tokens) - 1, 1)


def make_baseline(name: str, target: Target, cache: dict | None = None):
    """`cache` shares one stock model between hf and hf-pld."""
    if name in ("hf", "hf-pld"):
        cache = {} if cache is None else cache
        if "model" not in cache:
            cache["model"] = stock_model(target)
        return HFGenerate(target, cache["model"], PLD_TOKENS if name == "hf-pld" else 0)
    if name == "llamacpp":
        return LlamaCpp(target)
    raise KeyError(name)
