"""Evaluation prompts: the built-in test splits (GSM8K, HumanEval, MBPP), the chat dev set, or any JSONL file."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

DATA = Path(__file__).parent / "data"
PROMPT_FIELDS = ("prompt", "question", "problem", "text", "turns")


class DatasetError(ValueError):
    """A dataset that cannot be read as prompts; the message names the file and the problem."""


def _mbpp(row: dict) -> str:
    # the first test tells the model the function's name and signature, as in the usual MBPP prompt
    return f"{row['text']}\nYour code should pass this test:\n{row['test_list'][0]}"


def _humaneval(row: dict) -> str:
    return f"Complete the following Python function.\n\n{row['prompt']}"


BUILTIN = {
    "gsm8k": ("gsm8k_test.jsonl", lambda row: row["question"]),
    "humaneval": ("humaneval.jsonl", _humaneval),
    "mbpp": ("mbpp_test.jsonl", _mbpp),
}


# the domains every drafter is measured on: the tables of the model cards, docs/results and the ship rule
DOMAINS = ("chat-dev", "gsm8k", "humaneval", "mbpp")

SHAREGPT = "prompts/sharegpt_prompts.jsonl"  # under the data folder
CHAT_DEV_SHARE = 0.05


def default_data_dir() -> Path:
    """The training prompt sets (not shipped): $TREEFLASH_DATA, else ../shared/data."""
    return Path(os.environ.get("TREEFLASH_DATA", "../shared/data"))


def is_chat_dev(sample_id: str) -> bool:
    """The chat dev set: a fixed 5 % of the ShareGPT prompts (ids "sharegpt/ROW"), chosen by a seeded hash of the
    id, that training never reads (`train.data` skips them) and `--dataset chat-dev` measures on."""
    if not sample_id.startswith("sharegpt/"):
        return False
    digest = hashlib.sha256(f"treeflash chat-dev 0:{sample_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") < CHAT_DEV_SHARE * 2 ** 64


def chat_dev_prompts(data_dir: Path | None = None) -> list[str]:
    path = (data_dir or default_data_dir()) / SHAREGPT
    if not path.is_file():
        raise DatasetError(f"chat-dev reads the ShareGPT prompts at {path}: not found (set TREEFLASH_DATA)")
    return [row["prompt"] for i, row in enumerate(read_jsonl(path)) if is_chat_dev(f"sharegpt/{row.get('id', i)}")]


def read_jsonl(path: Path) -> list[dict]:
    rows = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as err:
                    raise DatasetError(f"{path}:{number}: not valid JSON ({err.msg})") from None
    return rows


def load_prompts(dataset: str, field: str | None = None, limit: int | None = None) -> list[str]:
    """Prompts of a built-in dataset (its test split), of the chat dev set or of a JSONL file, in file order."""
    if dataset == "chat-dev":
        prompts = chat_dev_prompts()
    elif dataset in BUILTIN:
        filename, to_prompt = BUILTIN[dataset]
        prompts = [to_prompt(row) for row in read_jsonl(DATA / filename)]
    else:
        path = Path(dataset)
        if path.suffix != ".jsonl":
            raise DatasetError(f"unknown dataset {dataset!r}; choose {', '.join(BUILTIN)}, chat-dev or a .jsonl file")
        if not path.is_file():
            raise DatasetError(f"no such file: {path}")
        prompts = [_field(row, field, path, i) for i, row in enumerate(read_jsonl(path), 1)]
    if not prompts:
        raise DatasetError(f"{dataset} has no prompts")
    return prompts[:limit] if limit else prompts


def _field(row: dict, field: str | None, path: Path, number: int) -> str:
    if not isinstance(row, dict):
        raise DatasetError(f"{path}:{number}: each line must be a JSON object")
    name = field or next((f for f in PROMPT_FIELDS if f in row), None)
    if name is None or name not in row:
        wanted = repr(field) if field else "any of " + ", ".join(PROMPT_FIELDS)
        raise DatasetError(f"{path}:{number}: no field {wanted} (fields: {', '.join(row) or 'none'})")
    value = row[name]
    if isinstance(value, list):  # multi-turn sets: the first turn
        value = value[0] if value else ""
    if not isinstance(value, str) or not value.strip():
        raise DatasetError(f"{path}:{number}: field {name!r} is not a non-empty string")
    return value
