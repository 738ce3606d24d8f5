"""Each engine alone, for the check that `bench`'s mixed run measures them fairly: tokens/s of llama.cpp's plain
decoding (in this process, nothing else loaded but the tokenizer) and of treeflash `ar` (in a fresh process), on
the same prompts as `treeflash bench --dataset D --limit N --max-new-tokens M` at T = 0.

    .venv/bin/python scripts/peers_alone.py --dataset gsm8k --limit 10 --max-new-tokens 128 [--engine llamacpp|ar]
"""

import argparse
import json
import time

import torch

from treeflash.eval.datasets import load_prompts
from treeflash.runtime import Target


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dataset", default="gsm8k")
    p.add_argument("--limit", type=int, default=10)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--engine", choices=["llamacpp", "ar"], required=True)
    args = p.parse_args()
    prompts = load_prompts(args.dataset, limit=args.limit)
    if args.engine == "ar":
        from treeflash.drafters import make_drafter
        from treeflash.engine import generate

        target = Target.load(dtype="auto", compile="auto")  # as the command line runs it
        drafter = make_drafter("ar", target)
        encoded = [target.encode_prompt(x) for x in prompts]
        generate(target, drafter, encoded[0], 8)  # warm-up, as bench does
        runs = [generate(target, drafter, ids, args.max_new_tokens) for ids in encoded]
        tokens, seconds = sum(len(r.tokens) for r in runs), sum(r.seconds for r in runs)
    else:
        from llama_cpp import Llama

        from treeflash.eval.baselines import gguf_file

        target = Target.load(dtype="float32", quantize="none")  # for its tokenizer, EOS ids and GGUF path
        encoded = [target.encode_prompt(x) for x in prompts]
        llm = Llama(model_path=str(gguf_file(target)), n_ctx=4096, n_threads=torch.get_num_threads(), verbose=False)
        del target.model
        tokens = seconds = 0
        for i, ids in enumerate([encoded[0]] + encoded):  # the first: warm-up
            llm.reset()
            out, start = [], time.perf_counter()
            for token in llm.generate(ids, temp=0.0, min_p=0.0, repeat_penalty=1.0, reset=True):
                out.append(token)
                if len(out) == (8 if i == 0 else args.max_new_tokens) or token in target.eos_ids:
                    break
            if i:
                tokens, seconds = tokens + len(out), seconds + time.perf_counter() - start
    print(json.dumps({"engine": args.engine, "dataset": args.dataset, "prompts": len(prompts),
                      "tokens": tokens, "seconds": seconds, "tokens_per_second": tokens / seconds}))


if __name__ == "__main__":
    main()
