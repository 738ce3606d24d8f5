"""llama.cpp's decoding speed alone, in ms a token, on the first GSM8K test prompt (greedy, 128 new tokens, 2 threads).
The prompt is fed one token per batch, so that no product has more than one row: that runs a build whose multi-row
AMX kernels fault (docs/results/int4-drafter, the AMX Xeon), and times decoding only.

    python scripts/llamacpp_decode_only.py [GGUF]     # default: the embedded SmolLM2 Q4_1
    PYTHONPATH=/tmp/llama-amx python scripts/llamacpp_decode_only.py   # another llama-cpp-python build
"""

import sys

from llama_cpp import Llama, llama_cpp

from treeflash.eval.datasets import load_prompts
from treeflash.runtime import DEFAULT_TARGET, gguf_file

path = sys.argv[1] if len(sys.argv) > 1 else str(gguf_file(DEFAULT_TARGET))
model = Llama(path, n_threads=2, n_ctx=1024, n_batch=1, n_ubatch=1, verbose=False)
messages = [{"role": "user", "content": load_prompts("gsm8k", limit=1)[0]}]
for run in range(3):  # llama.cpp's counters add up over the runs
    model.reset()
    model.create_chat_completion(messages, max_tokens=128, temperature=0)
    perf = llama_cpp.llama_perf_context(model._ctx.ctx)
    print(f"run {run}: prompt {perf.n_p_eval} tokens in {perf.t_p_eval_ms:.0f} ms; decoding "
          f"{perf.t_eval_ms / max(perf.n_eval, 1):.2f} ms a token over {perf.n_eval} tokens", flush=True)
