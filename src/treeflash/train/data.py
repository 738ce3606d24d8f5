"""Self-distillation data: the target regenerates the answers of training prompts.

Drafters learn to predict what the target itself writes, so the training text is the target's own greedy output
for training prompts (GSM8K train, the MBPP tasks outside its test split, ShareGPT and Code Alpaca prompts), never
the evaluation splits. Generation is batched (continuous batching on the static runtime, else left-padded HF
`generate` batches) and resumable: answers land in an answer store (`store.py`) a shard at a time, and a rerun skips
the prompt ids the store holds.
"""

from __future__ import annotations

import random
import time
import zlib
from collections import Counter
from pathlib import Path
from typing import Iterator

import torch
from tqdm import tqdm

from ..eval.datasets import SHAREGPT, DatasetError, is_chat_dev, read_jsonl
from ..runtime import Target
from ..verify import Sampling
from .magpie import SOURCE as MAGPIE
from .processes import process_share
from .store import AnswerStore

MBPP_TEST_IDS = range(11, 511)  # the MBPP test split: never trained on


def _mbpp_prompt(row: dict) -> str:
    return f"{row['text']}\nYour code should pass this test:\n{row['test_list'][0]}"


# source name -> (file under the data dir, id of a row, prompt of a row, keep the row?)
SOURCES = {
    "gsm8k": ("gsm8k/train.jsonl", lambda i, r: i, lambda r: r["question"], lambda r: True),
    "mbpp": ("mbpp/mbpp.jsonl", lambda i, r: r["task_id"], _mbpp_prompt,
             lambda r: r["task_id"] not in MBPP_TEST_IDS),
    "sharegpt": (SHAREGPT, lambda i, r: r.get("id", i), lambda r: r["prompt"], lambda r: True),
    "code_alpaca": ("prompts/code_alpaca_2k_prompts.jsonl", lambda i, r: i, lambda r: r["prompt"], lambda r: True),
}


def training_prompts(data_dir: Path, sources: list[str]) -> list[tuple[str, str]]:
    """(id, prompt) pairs of the chosen training sources, ids like 'gsm8k/17'."""
    out = []
    for name in sources:
        if name == MAGPIE:
            raise DatasetError("magpie's prompts are the target's own: `treeflash data magpie` writes and answers "
                               "them, and the answer store keeps them")
        if name not in SOURCES:
            raise DatasetError(f"unknown training source {name!r}; choose from {', '.join(SOURCES)}")
        path, row_id, prompt, keep = SOURCES[name]
        if not (data_dir / path).is_file():
            raise DatasetError(f"no such file: {data_dir / path} (set --data-dir or TREEFLASH_DATA)")
        rows = [(f"{name}/{row_id(i, r)}", prompt(r)) for i, r in enumerate(read_jsonl(data_dir / path)) if keep(r)]
        out += [(i, p) for i, p in rows if not is_chat_dev(i)]  # the chat dev set is never trained on
    return out


@torch.inference_mode()
def generate_batch(target: Target, prompts: list[list[int]], max_new_tokens: int,
                   temperature: float = 0.0) -> list[list[int]]:
    """Answers for a batch of prompts (left padded), each cut after its first EOS: greedy at temperature 0, else
    plain samples of the target at that temperature (no top-k / top-p, whatever the model's generation config)."""
    pad = target.tokenizer.pad_token_id if target.tokenizer.pad_token_id is not None else min(target.eos_ids)
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(prompts):
        ids[row, width - len(p):] = torch.tensor(p)
        mask[row, width - len(p):] = 1
    sampling = (dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if temperature > 0
                else dict(do_sample=False))
    out = target.model.generate(input_ids=ids.to(target.device), attention_mask=mask.to(target.device),
                                max_new_tokens=max_new_tokens, pad_token_id=pad,
                                eos_token_id=sorted(target.eos_ids), **sampling)
    answers = []
    for row in out[:, width:].tolist():
        end = next((i + 1 for i, t in enumerate(row) if t in target.eos_ids), len(row))
        answers.append(row[:end])
    return answers


def regenerate(target: Target, prompts: list[tuple[str, str]], store: AnswerStore, meta: dict,
               max_new_tokens: int = 256, batch_size: int = 32, max_prompt_tokens: int = 512, seed: int = 0,
               temperature: float = 0.0, shard_size: int = 512) -> dict:
    """Append the target's answers for `prompts` to `store`, a shard of `shard_size` answers at a time (`meta`:
    what its manifest lines record of the run); prompts the store answered already at this temperature (and seed,
    when sampling) are skipped, so a rerun resumes. Returns throughput figures.

    Greedy answers (temperature 0) only ever show a drafter previous tokens that are the target's argmax; sampled
    ones (temperature 1) also show it the other tokens that tree branches and T > 0 decoding condition on."""
    todo = list(prompts)
    random.Random(seed).shuffle(todo)  # sources mixed, so a partial run is still a balanced sample
    rank, world = process_share()
    # Under torchrun each process answers its share into the same store. The shares are cut before the store is
    # read: a process that reads it after another one's first shard would otherwise cut other shares and drop ids.
    share = todo[rank::world]
    skip = store.done(temperature, seed)
    todo = [(i, p) for i, p in share if i not in skip]
    encoded = [(i, target.encode_prompt(p)) for i, p in todo]
    encoded = [(i, ids) for i, ids in encoded if len(ids) <= max_prompt_tokens]
    too_long = len(todo) - len(encoded)
    meta = {**meta, "temperature": temperature, "seed": seed, "max_new_tokens": max_new_tokens}
    tokens, started, pending = 0, time.time(), []
    bar = tqdm(total=len(encoded), desc=f"regen {rank + 1}/{world}" if world > 1 else "regen", unit="prompt",
               position=rank)

    def flush():
        store.append([r["id"] for r in pending], [r["prompt_ids"] for r in pending],
                     [r["response_ids"] for r in pending], meta)
        pending.clear()

    for rows in answerer(target)(target, encoded, max_new_tokens, batch_size, seed, temperature):
        pending += rows
        if len(pending) >= shard_size:
            flush()
        tokens += sum(len(r["response_ids"]) for r in rows)
        bar.update(len(rows))
        bar.set_postfix(tok_s=f"{tokens / (time.time() - started):.0f}")
    if pending:
        flush()
    bar.close()
    seconds = time.time() - started
    return {"prompts": len(encoded), "skipped_done": len(share) - len(todo), "skipped_too_long": too_long, "new_tokens": tokens,
            "seconds": seconds, "tokens_per_second": tokens / max(seconds, 1e-9)}


def answerer(target: Target):
    """How `target` answers a list of encoded prompts: continuous batching where the static runtime runs, else
    the padded HF batches (the reference)."""
    return answer_continuously if target.static is not None else answer_in_batches


def _row(prompt_id: str, ids: list[int], answer: list[int], temperature: float) -> dict:
    return {"id": prompt_id, "prompt_ids": ids, "response_ids": answer, "temperature": temperature}


def answer_continuously(target: Target, encoded: list[tuple[str, list[int]]], max_new_tokens: int, batch_size: int,
                        seed: int, temperature: float) -> Iterator[list[dict]]:
    """Answers by the static runtime's continuous batching (`BatchEngine` with AR steps), `batch_size` at a time: a
    finished answer's slot goes to the next prompt at once, where a padded batch runs until its longest answer
    ends. Each prompt samples from its own generator, seeded by the run's seed and its id (a resumed run draws
    what an uninterrupted one would)."""
    from ..batching import BatchEngine
    from ..drafters import make_drafter

    engine = BatchEngine(target, make_drafter("ar"), batch_size, budget=1)
    seeds = [zlib.crc32(f"{seed}/{prompt_id}".encode()) for prompt_id, _ in encoded]
    finished = []
    for request in engine.stream([ids for _, ids in encoded], max_new_tokens, Sampling(temperature), seeds):
        finished.append(_row(*encoded[request.data["index"]], request.result.tokens, temperature))
        if len(finished) == batch_size:
            yield finished
            finished = []
    if finished:
        yield finished


def answer_in_batches(target: Target, encoded: list[tuple[str, list[int]]], max_new_tokens: int, batch_size: int,
                      seed: int, temperature: float) -> Iterator[list[dict]]:
    """Answers by HF `generate` on left-padded batches: for targets without the static runtime (and the reference
    the continuous path is tested against)."""
    torch.manual_seed(seed)
    # sort each group of 8 batches by prompt length: less padding, order still mixed across the run
    for g in range(0, len(encoded), 8 * batch_size):
        group = sorted(encoded[g:g + 8 * batch_size], key=lambda x: len(x[1]))
        for b in range(0, len(group), batch_size):
            batch = group[b:b + batch_size]
            answers = generate_batch(target, [ids for _, ids in batch], max_new_tokens, temperature)
            yield [_row(i, ids, a, temperature) for (i, ids), a in zip(batch, answers)]


def source_commit() -> str | None:
    """The git commit of the treeflash source that runs, when it runs from a checkout."""
    import subprocess

    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def token_ranking(responses: list[list[int]]) -> tuple[list[int], dict]:
    """Token ids by how often they occur in the regenerated answers (most frequent first; ties by id), and the
    counts behind it: FR-Spec's draft vocabulary is a prefix of this list."""
    counts = Counter(t for response in responses for t in response)
    ranking = sorted(counts, key=lambda t: (-counts[t], t))
    return ranking, {"answers": len(responses), "tokens": sum(counts.values()), "distinct": len(ranking)}
