"""Other engines on the same prompts, for `bench`: what a user would run instead of treeflash.

- `hf`: transformers' own `generate` on the target's model, with the same sampling;
- `hf-pld`: the same with transformers' prompt lookup decoding (`prompt_lookup_num_tokens`);
- `llamacpp`: plain decoding of the target's GGUF file through llama-cpp-python (an optional extra: PyPI ships
  only its source), in a process of its own; `llamacpp-pld`: the same with llama.cpp's own prompt lookup. Both
  compute on the GGUF's quantised weights in llama.cpp's own way, so their tokens may differ from the target's.

Each returns the new tokens, the seconds they took and the number of target forwards (τ = tokens / forwards).
"""

from __future__ import annotations

import importlib.util
import json
import signal
import subprocess
import sys
import weakref
from pathlib import Path

import torch

from ..clock import now
from ..runtime import EMBEDDED, Target, gguf_file as target_gguf, resolve
from ..verify import Sampling

BASELINES = ("hf", "hf-pld", "llamacpp", "llamacpp-pld")
PLD_TOKENS = 10  # transformers' documented example value
LLAMACPP_PLD_TOKENS = 4  # of 4 and 10 (llama-cpp-python's default), 4 was faster on GSM8K (DESIGN section 8)


class BaselineUnavailable(RuntimeError):
    """A baseline that cannot run here (reported as skipped, never as a crash)."""


def gguf_file(target: Target) -> Path:
    path = target_gguf(target.name)
    if path is None:
        raise BaselineUnavailable(f"llamacpp needs a GGUF target (got {target.name})")
    return path


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
    """llama.cpp's decoding of the target's GGUF, with as many threads as torch uses, in a process of its own
    (`llamacpp_worker.py`) so that neither engine's threads spin against the other's. `draft` tokens: llama.cpp's
    own prompt lookup (`LlamaPromptLookupDecoding`), 0: plain decoding."""

    def __init__(self, target: Target, draft: int = 0):
        if importlib.util.find_spec("llama_cpp") is None:
            raise BaselineUnavailable("llama-cpp-python is not installed (CMAKE_BUILD_PARALLEL_LEVEL=2 pip install "
                                      "llama-cpp-python==0.3.36: a source build of 15-30 minutes)")
        self.eos = sorted(target.eos_ids)
        command = [sys.executable, str(Path(__file__).with_name("llamacpp_worker.py")), str(gguf_file(target)),
                   str(torch.get_num_threads()), str(min(target.context_length, 4096)), str(draft)]
        self.worker = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        weakref.finalize(self, self.worker.kill)
        if json.loads(self._read()).get("ready") is not True:
            raise BaselineUnavailable("the llama.cpp worker did not start")

    def _read(self) -> str:
        line = self.worker.stdout.readline()
        if not line:
            code = self.worker.wait()
            # a build targets the CPU it was built on (pip may reuse a wheel cached on another machine), and
            # llama.cpp's AMX kernels fault where a hypervisor leaves AMX off (docs/results/int4-drafter)
            hint = (": an illegal instruction, so llama-cpp-python was built for another CPU or uses instructions "
                    "this machine does not enable (AMX in some VMs); rebuild it here with pip install --no-cache-dir "
                    "--force-reinstall llama-cpp-python==0.3.36, with CMAKE_ARGS='-DGGML_NATIVE=OFF -DGGML_AVX512=ON' "
                    "to leave AMX out" if code == -signal.SIGILL else "")
            raise BaselineUnavailable(f"the llama.cpp worker stopped (exit code {code}){hint}")
        return line

    def __call__(self, prompt: list[int], max_new_tokens: int, sampling: Sampling, seed: int):
        request = {"prompt": prompt, "max_new_tokens": max_new_tokens, "temperature": sampling.temperature,
                   "top_k": sampling.top_k, "top_p": sampling.top_p, "seed": seed, "eos": self.eos}
        self.worker.stdin.write(json.dumps(request) + "\n")
        self.worker.stdin.flush()
        answer = json.loads(self._read())  # this process blocks here: its threads sleep while llama.cpp runs
        return answer["tokens"], answer["seconds"], answer["forwards"]


def make_baseline(name: str, target: Target, cache: dict | None = None):
    """`cache` shares one stock model between hf and hf-pld."""
    if name in ("hf", "hf-pld"):
        cache = {} if cache is None else cache
        if "model" not in cache:
            cache["model"] = stock_model(target)
        return HFGenerate(target, cache["model"], PLD_TOKENS if name == "hf-pld" else 0)
    if name == "llamacpp":
        return LlamaCpp(target)
    if name == "llamacpp-pld":
        return LlamaCpp(target, draft=LLAMACPP_PLD_TOKENS)
    raise KeyError(name)
