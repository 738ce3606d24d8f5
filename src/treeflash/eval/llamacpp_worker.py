"""llama.cpp in a process of its own, for `bench`: run as a script (it imports neither torch nor treeflash), it
decodes the requests it reads from stdin, one JSON object a line, and answers each on stdout.

Why a process: llama.cpp's threads and torch's OpenMP threads spin while they wait for work; in one process on a
2-core machine each engine lost about a quarter of its speed to the other. Here the idle side blocks on a pipe.

    python llamacpp_worker.py MODEL.gguf THREADS CONTEXT DRAFT_TOKENS   (DRAFT_TOKENS 0: plain decoding, else
                                                                        llama.cpp's own prompt lookup)
    request:  {"prompt": [ids], "max_new_tokens": n, "temperature": t, "top_k": k, "top_p": p, "seed": s,
               "eos": [ids]}
    answer:   {"tokens": [ids], "seconds": s, "forwards": n} (forwards: target evaluations after the prompt's)
"""

import json
import sys
import time


def main() -> None:
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    model, threads, context, draft = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    # with a draft model llama-cpp-python keeps every position's logits but sizes their buffer by logits_all
    # (0.3.36: prompts longer than a batch overflow it), so ask for them outright
    llm = Llama(model_path=model, n_ctx=context, n_threads=threads, n_threads_batch=threads, verbose=False,
                logits_all=bool(draft), draft_model=LlamaPromptLookupDecoding(num_pred_tokens=draft) if draft else None)
    evals = 0
    plain_eval = llm.eval

    def counted_eval(tokens):  # one call: one target forward over the new tokens (the drafts included)
        nonlocal evals
        evals += 1
        return plain_eval(tokens)

    llm.eval = counted_eval
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        r = json.loads(line)
        llm.reset()  # no prefix reuse from the previous prompt: every engine prefills the whole prompt
        llm.set_seed(r["seed"])
        eos, tokens = set(r["eos"]), []
        evals = 0
        start = time.perf_counter()
        # min_p 0 and repeat penalty 1: the target's own distribution, as every treeflash method samples it
        for token in llm.generate(r["prompt"], temp=r["temperature"], top_k=r["top_k"], top_p=r["top_p"],
                                  min_p=0.0, repeat_penalty=1.0, reset=True):
            tokens.append(token)
            if len(tokens) == r["max_new_tokens"] or token in eos:
                break
        seconds = time.perf_counter() - start
        print(json.dumps({"tokens": tokens, "seconds": seconds, "forwards": max(evals - 1, 1)}), flush=True)


if __name__ == "__main__":
    main()
