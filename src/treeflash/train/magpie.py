"""Prompts the target writes itself (Magpie, Xu et al. 2024): more chat prompts where the prompt sets are thin.

A chat model given its template up to the start of a user turn, and nothing else, writes a user's request. Sampled
at T = 1 (one turn per id, each from its own seeded generator) and answered greedily like any training prompt,
these turns add requests the prompt sets do not hold: `../shared/data` has 3,056 ShareGPT training prompts and no
more. No prompt set holds such a prompt to read it back from, so the answer store keeps its ids beside its answer
(`store.py`): the target's own text, like the answers.
"""

from __future__ import annotations

import time

from tqdm import tqdm

from ..eval.datasets import DatasetError
from .processes import process_share
from .store import AnswerStore

SOURCE = "magpie"
_SENTINEL = "\x00treeflash-user-turn\x00"


def user_turn_template(target) -> tuple[list[int], list[int]]:
    """The ids of the chat template before a user turn's text (system prompt, user header) and after it (end of
    turn, assistant header)."""
    tok = target.tokenizer
    if not getattr(tok, "chat_template", None):
        raise DatasetError(f"{target.name} has no chat template: it cannot be asked for a user turn")
    text = tok.apply_chat_template([{"role": "user", "content": _SENTINEL}], tokenize=False,
                                   add_generation_prompt=True)
    before, _, after = text.partition(_SENTINEL)
    return tok(before, add_special_tokens=False).input_ids, tok(after, add_special_tokens=False).input_ids


def written_turn(ids: list[int], eos_ids: frozenset[int], special: set[int]) -> list[int] | None:
    """The text of a sampled user turn, or None where it is no request: cut off before its end (no EOS), empty, or
    holding a special token (a turn that writes the template itself)."""
    if not ids or ids[-1] not in eos_ids or len(ids) == 1 or special.intersection(ids[:-1]):
        return None
    return ids[:-1]


def write_magpie(target, store: AnswerStore, count: int, meta: dict, batch_size: int = 32, seed: int = 0,
                 temperature: float = 1.0, turn_tokens: int = 128, max_new_tokens: int = 256,
                 shard_size: int = 512) -> dict:
    """Prompts the target writes, ids magpie/SEED-K for K < `count`, each answered greedily, into `store` with
    their ids, a shard per `shard_size` ids tried; a rerun resumes with the ids the store lacks. A turn is kept
    when `written_turn` keeps it and the store holds no equal prompt (the shortest requests repeat). Returns
    counts and throughput."""
    from .data import answerer

    before, after = user_turn_template(target)
    special = set(target.tokenizer.all_special_ids)
    rank, world = process_share()  # under torchrun each process writes its share
    done = store.done(0.0, seed)  # the ids carry the seed; greedy answers are looked up without one
    share = [f"{SOURCE}/{seed}-{k}" for k in range(count)][rank::world]
    todo = [i for i in share if i not in done]
    held = {tuple(a.prompt_ids) for a in store.answers() if a.source == SOURCE}
    answer = answerer(target)
    meta = {**meta, "temperature": 0.0, "seed": seed, "max_new_tokens": max_new_tokens,
            "turn_temperature": temperature, "turn_tokens": turn_tokens}
    kept = tokens = 0
    started = time.time()
    bar = tqdm(total=len(todo), desc="magpie", unit="prompt", position=rank)
    for start in range(0, len(todo), shard_size):
        chunk = [(i, before) for i in todo[start:start + shard_size]]
        prompts = []
        for rows in answer(target, chunk, turn_tokens, batch_size, seed, temperature):
            for r in rows:
                turn = written_turn(r["response_ids"], target.eos_ids, special)
                prompt = None if turn is None else before + turn + after
                if prompt is not None and tuple(prompt) not in held:
                    held.add(tuple(prompt))
                    prompts.append((r["id"], prompt))
        rows = [r for batch in answer(target, prompts, max_new_tokens, batch_size, seed, 0.0) for r in batch]
        if rows:
            store.append([r["id"] for r in rows], [r["prompt_ids"] for r in rows], [r["response_ids"] for r in rows],
                         meta, keep_prompts=True)
        kept += len(rows)
        tokens += sum(len(r["response_ids"]) for r in rows)
        bar.update(len(chunk))
        bar.set_postfix(kept=kept, tok_s=f"{tokens / (time.time() - started):.0f}")
    bar.close()
    seconds = time.time() - started
    return {"tried": len(todo), "kept": kept, "skipped_done": len(share) - len(todo), "new_tokens": tokens,
            "seconds": seconds, "tokens_per_second": tokens / max(seconds, 1e-9)}
