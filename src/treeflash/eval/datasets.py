"""Evaluation prompts: the built-in test splits (GSM8K, HumanEval, MBPP) or any JSONL file."""

from __future__ import annotations

import json
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
    """Prompts of a built-in dataset (its test split) or of a JSONL file, in file order."""
    if dataset in BUILTIN:
        filename, to_prompt = BUILTIN[dataset]
        prompts = [to_prompt(row) for row in read_jsonl(DATA / filename)]
    else:
        path = Path(dataset)
        if path.suffix != ".jsonl":
            raise DatasetError(f"unknown dataset {dataset!r}; choose {', '.join(BUILTIN)} or a .jsonl file")
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
