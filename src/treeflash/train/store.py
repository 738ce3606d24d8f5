"""The answer store: the target's regenerated answers as token ids, kept in the repository (`data/answers`).

A store is a folder of compressed shards and one append-only `manifest.jsonl`, a line per shard:

    {"shard": "shard-00003.npz", "sha256": ..., "ids": ["gsm8k/17", ...], "answers": 512, "tokens": 95310,
     "temperature": 0.0, "seed": 0, "target": ..., "dtype": ..., "max_new_tokens": 256, "commit": ...,
     "command": "treeflash data regen ...", "time": ...}

A shard holds the answers of its manifest line's ids, in that order: `tokens` (every answer's ids, concatenated;
uint16 while the vocabulary fits), `lengths`, and `prompt_crc` (crc32 of each prompt's token ids). No prompt of a
prompt set is stored: training reads each prompt back by its id from the prompt sets and encodes it again, and the
checksum says when that no longer gives the ids the answer was made for (another tokenizer, chat template or data
file). A prompt the target wrote itself (`magpie.py`) has no prompt set to be read from: its shard holds its ids too
(`prompt_tokens`, `prompt_lengths`), the target's text like the answers.

A shard is written to a temporary file and renamed before its manifest line is appended, so an interrupted run
leaves whole shards only; a shard without a manifest line is not part of the store (the next write replaces it).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import time
import zlib
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator

import numpy as np

try:  # POSIX: processes that append together take turns (elsewhere regen runs as one process)
    import fcntl
except ImportError:  # pragma: no cover
    fcntl = None

from ..eval.datasets import DatasetError, is_chat_dev

MANIFEST = "manifest.jsonl"
DEFAULT_STORE = "data/answers"  # the repository's store, from the checkout's root


def prompt_checksum(prompt_ids: list[int]) -> int:
    return zlib.crc32(np.asarray(prompt_ids, dtype=np.int64).tobytes())


@dataclass
class Answer:
    id: str  # the prompt's id, "source/row id"
    response_ids: list[int]
    temperature: float
    prompt_crc: int
    prompt_ids: list[int] | None = None  # a prompt the target wrote (no prompt set holds it); else read back by id

    @property
    def source(self) -> str:
        return self.id.split("/")[0]


class AnswerStore:
    def __init__(self, folder: str | Path):
        self.folder = Path(folder)

    @property
    def manifest_path(self) -> Path:
        return self.folder / MANIFEST

    def entries(self) -> list[dict]:
        """The manifest's lines, one per shard, in the order they were written."""
        if not self.manifest_path.is_file():
            return []
        with open(self.manifest_path) as f:
            return [json.loads(line) for line in f if line.strip()]

    def done(self, temperature: float, seed: int) -> set[str]:
        """Ids answered already at this temperature (greedy answers do not depend on the seed; samples do)."""
        return {i for e in self.entries() if e["temperature"] == temperature
                and (temperature == 0 or e["seed"] == seed) for i in e["ids"]}

    @contextmanager
    def _locked(self) -> Iterator[None]:
        """The store to this process alone (processes of one `data regen` under torchrun append to it together)."""
        self.folder.mkdir(parents=True, exist_ok=True)
        with open(self.folder / ".lock", "w") as lock:
            if fcntl is not None:
                fcntl.flock(lock, fcntl.LOCK_EX)
            yield

    def append(self, ids: list[str], prompt_ids: list[list[int]], answers: list[list[int]], meta: dict,
               keep_prompts: bool = False) -> dict:
        """Write one shard of answers and its manifest line; `meta` holds the run's settings (temperature, seed,
        target, dtype, max_new_tokens, command); `keep_prompts` stores the prompts' ids too (prompts the target
        wrote). Returns the manifest line."""
        with self._locked():
            return self._append(ids, prompt_ids, answers, meta, keep_prompts)

    def _append(self, ids: list[str], prompt_ids: list[list[int]], answers: list[list[int]], meta: dict,
                keep_prompts: bool) -> dict:
        entries = self.entries()
        if entries and entries[0].get("target") != meta.get("target"):
            raise DatasetError(f"{self.folder} holds answers of target {entries[0].get('target')!r}, not "
                               f"{meta.get('target')!r}: use another --out")
        arrays = {"tokens": _packed(answers), "lengths": np.asarray([len(a) for a in answers], dtype=np.uint32),
                  "prompt_crc": np.asarray([prompt_checksum(p) for p in prompt_ids], dtype=np.uint32)}
        if keep_prompts:
            arrays |= {"prompt_tokens": _packed(prompt_ids),
                       "prompt_lengths": np.asarray([len(p) for p in prompt_ids], dtype=np.uint32)}
        buffer = io.BytesIO()
        np.savez_compressed(buffer, **arrays)
        data = buffer.getvalue()
        name = f"shard-{len(entries):05d}.npz"
        tmp = self.folder / f".{name}.tmp"
        tmp.write_bytes(data)
        os.replace(tmp, self.folder / name)
        entry = {"shard": name, "sha256": hashlib.sha256(data).hexdigest(), "answers": len(ids),
                 "tokens": sum(map(len, answers)), **meta, "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
                 "ids": list(ids)}
        with open(self.manifest_path, "a") as f:
            f.write(json.dumps(entry) + "\n")
            f.flush()
            os.fsync(f.fileno())
        return entry

    def answers(self) -> Iterable[Answer]:
        """Every answer, shard by shard; chat-dev answers are never yielded (that set stays held out)."""
        for entry in self.entries():
            shard = self.folder / entry["shard"]
            if not shard.is_file():
                raise DatasetError(f"{shard} is missing (named in {self.manifest_path})")
            with np.load(shard, allow_pickle=False) as z:
                answers, crcs = _unpacked(z["tokens"], z["lengths"]), z["prompt_crc"]
                prompts = _unpacked(z["prompt_tokens"], z["prompt_lengths"]) if "prompt_tokens" in z else None
            if len(answers) != len(entry["ids"]):
                raise DatasetError(f"{shard} holds {len(answers)} answers, its manifest line {len(entry['ids'])}")
            for k, (i, answer, crc) in enumerate(zip(entry["ids"], answers, crcs)):
                if not is_chat_dev(i):
                    yield Answer(i, answer, entry["temperature"], int(crc), prompts[k] if prompts else None)

    def verify(self) -> list[str]:
        """Problems with the store (none: []): shards missing, changed (sha256), or disagreeing with their
        manifest line's counts; ids answered twice at one temperature and seed; files the manifest does not name."""
        problems, seen = [], set()
        entries = self.entries()
        for entry in entries:
            shard = self.folder / entry["shard"]
            if not shard.is_file():
                problems.append(f"{entry['shard']}: missing")
                continue
            if hashlib.sha256(shard.read_bytes()).hexdigest() != entry["sha256"]:
                problems.append(f"{entry['shard']}: sha256 differs from the manifest's")
                continue
            with np.load(shard, allow_pickle=False) as z:
                lengths = z["lengths"]
                counts = (len(lengths), int(lengths.sum()), len(z["prompt_crc"]), len(z["tokens"]))
            if counts != (entry["answers"], entry["tokens"], entry["answers"], entry["tokens"]) \
                    or len(entry["ids"]) != entry["answers"]:
                problems.append(f"{entry['shard']}: counts differ from the manifest's")
            for i in entry["ids"]:
                key = (i, entry["temperature"], entry["seed"] if entry["temperature"] else None)
                if key in seen:
                    problems.append(f"{entry['shard']}: {i} answered twice at T={entry['temperature']:g}")
                seen.add(key)
        named = {e["shard"] for e in entries} | {MANIFEST, "README.md"}
        problems += [f"{p.name}: not in the manifest" for p in sorted(self.folder.glob("*"))
                     if p.name not in named and not p.name.startswith(".")]
        return problems

    def summary(self) -> dict:
        """Answers and tokens per source and temperature (chat-dev excluded, as training excludes it), and the
        runs that made them (distinct commands and commits)."""
        by_source: dict[str, dict[str, int]] = {}
        runs: dict[tuple, dict] = {}
        for e in self.entries():
            for i in e["ids"]:
                if not is_chat_dev(i):
                    c = by_source.setdefault(f"{i.split('/')[0]} T={e['temperature']:g}", {"answers": 0})
                    c["answers"] += 1
            run = runs.setdefault((e.get("command"), e.get("commit")), {
                "command": e.get("command"), "commit": e.get("commit"), "target": e.get("target"),
                "dtype": e.get("dtype"), "first_shard": e["shard"], "shards": 0, "answers": 0, "tokens": 0})
            run["shards"] += 1
            run["answers"] += e["answers"]
            run["tokens"] += e["tokens"]
        return {"store": str(self.folder), "answers": sum(c["answers"] for c in by_source.values()),
                "tokens": sum(r["tokens"] for r in runs.values()), "by_source": dict(sorted(by_source.items())),
                "runs": list(runs.values())}


def _packed(rows: list[list[int]]) -> np.ndarray:
    """Token id lists concatenated, uint16 while the vocabulary fits."""
    width = np.uint16 if max((max(r, default=0) for r in rows), default=0) < 2 ** 16 else np.uint32
    return np.fromiter((t for r in rows for t in r), dtype=width)


def _unpacked(tokens: np.ndarray, lengths: np.ndarray) -> list[list[int]]:
    ends = np.cumsum(lengths)
    return [tokens[end - length:end].tolist() for end, length in zip(ends, lengths)]


def stores(paths: str | Path) -> list[AnswerStore]:
    """One store, or several separated by commas; each must hold answers."""
    out = [AnswerStore(p) for p in str(paths).split(",") if p]
    for store in out:
        if not store.entries():
            raise DatasetError(f"no answers in {store.folder} (run `treeflash data regen --out {store.folder}`)")
    return out


def _require_sources(option: str, names: Iterable[str], answers: list[Answer]) -> None:
    """A clear error when `option` names a source that none of the answers comes from."""
    held = {a.source for a in answers}
    if unknown := sorted(set(names) - held):
        raise DatasetError(f"{option}: the answers hold none of {', '.join(unknown)} "
                           f"(they hold {', '.join(sorted(held))})")


def select_sources(answers: list[Answer], spec: str | None) -> list[Answer]:
    """The answers of the sources `spec` names (commas): `sharegpt` keeps all of that source's answers,
    `gsm8k:300` the first 300 in the stores' order (None: every answer). A fine-tune that should lean on one
    domain, the chat Weaver's, keeps that source whole and a few hundred of each other."""
    if spec is None:
        return answers
    caps: dict[str, int | None] = {}
    for item in (s.strip() for s in spec.split(",") if s.strip()):
        name, _, cap = item.partition(":")
        if cap and not (cap.isdigit() and int(cap) > 0):
            raise DatasetError(f"--sources {item!r}: a cap is a positive count, as in {name}:300")
        caps[name] = int(cap) if cap else None
    _require_sources("--sources", caps, answers)
    kept, seen = [], dict.fromkeys(caps, 0)
    for a in answers:
        if a.source in caps and (caps[a.source] is None or seen[a.source] < caps[a.source]):
            seen[a.source] += 1
            kept.append(a)
    return kept


def repeat_answers(answers: list[Answer], spec: str | None) -> list[Answer]:
    """The answers with some of them repeated (commas): `sharegpt=3` takes each of that source's answers three
    times an epoch, `sharegpt@0=3` its greedy ones only (`@1`: its T = 1 samples). A stage that should lean on a
    weak domain weights it up without dropping the others' text (None: each answer once)."""
    if spec is None:
        return answers
    times: dict[tuple[str, float | None], int] = {}
    for item in (s.strip() for s in spec.split(",") if s.strip()):
        key, _, count = item.partition("=")
        name, at, temperature = key.partition("@")
        try:
            n, t = int(count), float(temperature) if at else None
        except ValueError:
            n = 0
        if n < 1:
            raise DatasetError(f"--repeat {item!r}: write SOURCE=N or SOURCE@TEMPERATURE=N with N >= 1, "
                               "as in sharegpt@0=3")
        times[name, t] = n
    _require_sources("--repeat", {name for name, _ in times}, answers)
    return [a for a in answers for _ in range(times.get((a.source, a.temperature), times.get((a.source, None), 1)))]


def load_answers(paths: str | Path, encode: Callable[[str], list[int]], data_dir: Path,
                 sources: str | None = None, repeat: str | None = None) -> list[dict]:
    """Training rows {id, prompt_ids, response_ids, temperature} of one store or several (commas), of the
    `sources` chosen (select_sources) and repeated as `repeat` says (repeat_answers), in a fixed order: each
    prompt read back by its id from the prompt sets in `data_dir` and encoded by `encode` (the target's chat
    template), or stored with its answer where the target wrote it, checked against the checksum its answer was
    stored with."""
    from .data import training_prompts

    answers = select_sources([a for store in stores(paths) for a in store.answers()], sources)
    answers = repeat_answers(answers, repeat)
    texts = dict(training_prompts(data_dir, sorted({a.source for a in answers if a.prompt_ids is None})))
    encoded: dict[str, list[int]] = {}
    rows, missing, changed = [], [], []
    for a in answers:
        if a.prompt_ids is not None:  # the target's own prompt, stored with its answer
            encoded[a.id] = a.prompt_ids
        elif a.id not in texts:
            missing.append(a.id)
            continue
        if a.id not in encoded:
            encoded[a.id] = encode(texts[a.id])
        if prompt_checksum(encoded[a.id]) != a.prompt_crc:
            changed.append(a.id)
            continue
        rows.append({"id": a.id, "prompt_ids": encoded[a.id], "response_ids": a.response_ids,
                     "temperature": a.temperature})
    if missing or changed:
        raise DatasetError(
            f"{len(missing)} answers have no prompt in {data_dir} (e.g. {(missing or ['-'])[0]}) and {len(changed)} "
            f"prompts encode to other ids than their answers were made for (e.g. {(changed or ['-'])[0]}): another "
            f"data folder, tokenizer or chat template than the store's ({paths})")
    return sorted(rows, key=lambda r: (r["temperature"], r["id"]))


def import_jsonl(folder: str | Path, store: AnswerStore, shard_size: int = 512) -> int:
    """Move the answers of a folder of JSONL shards (`data regen` before the store: rows {id, prompt_ids,
    response_ids, temperature} and a runs.jsonl of settings and commits) into `store`, skipping answers it holds.
    Returns the answers added."""
    from ..eval.datasets import read_jsonl

    folder = Path(folder)
    runs_file = folder / "runs.jsonl"
    runs = [r for r in read_jsonl(runs_file) if r["event"] == "started"] if runs_file.is_file() else []
    if not runs:
        raise DatasetError(f"{folder} has no runs.jsonl naming the run that made it")
    run = runs[0]
    rows = [r for shard in sorted(folder.glob("shard-*.jsonl")) for r in read_jsonl(shard)]
    flags = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in run.items()
                     if k not in ("time", "commit", "event") and v is not None)
    meta = {"target": run["target"], "dtype": run["dtype"], "seed": run["seed"],
            "max_new_tokens": run["max_new_tokens"], "commit": run["commit"],
            "command": f"treeflash data regen {flags}", "imported_from": folder.name}
    added = 0
    for temperature in sorted({r.get("temperature", 0.0) for r in rows}):
        done = store.done(temperature, run["seed"])
        todo = [r for r in rows if r.get("temperature", 0.0) == temperature and r["id"] not in done
                and not is_chat_dev(r["id"])]
        for start in range(0, len(todo), shard_size):
            part = todo[start:start + shard_size]
            store.append([r["id"] for r in part], [r["prompt_ids"] for r in part], [r["response_ids"] for r in part],
                         {**meta, "temperature": temperature})
            added += len(part)
    return added
