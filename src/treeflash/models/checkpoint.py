"""Checkpoint IO in one place: the save_pretrained layout (config.json + model.safetensors) that every treeflash
model writes, strict loading (a key that is missing or left over is an error, never silently dropped), and the
digest by which an adapter checks that it sits on the backbone it was trained on."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn


class DrafterError(ValueError):
    """A drafter checkpoint that cannot be used (unreadable, or it does not fit the target)."""


def misfits(config, target_config) -> list[str]:
    """What keeps a drafter of `config` (its hidden_size, vocab_size and target_layer_ids) off a target of
    `target_config` (a text decoder's): empty where it fits."""
    c, tc, problems = config, target_config, []
    if tc.hidden_size != c.hidden_size:
        problems.append(f"hidden size {c.hidden_size} vs the target's {tc.hidden_size}")
    if tc.vocab_size != c.vocab_size:
        problems.append(f"vocabulary {c.vocab_size} vs the target's {tc.vocab_size}")
    if max(c.target_layer_ids) >= tc.num_hidden_layers:
        problems.append(f"taps layers {c.target_layer_ids}, the target has {tc.num_hidden_layers}")
    return problems


def error_line(err: BaseException) -> str:
    """An exception's message as one line for a one-line error (its type where it has no message)."""
    return (str(err) or type(err).__name__).splitlines()[0]


def save_checkpoint(state: dict[str, torch.Tensor], config: dict, folder: str | Path, dtype: torch.dtype) -> None:
    """The save_pretrained layout: config.json and model.safetensors (floating tensors cast to `dtype`; integer and
    boolean ones, e.g. EAGLE-3's vocabulary maps, kept as they are)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    state = {k: (v.to(dtype) if v.is_floating_point() else v).detach().contiguous() for k, v in state.items()}
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})


def read_weights(folder: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of the folder's *.safetensors files (sharded checkpoints included)."""
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no weights (*.safetensors) in {folder}")
    state = {}
    for f in files:
        try:
            state.update(load_file(str(f)))
        except Exception as err:  # safetensors' own error type: truncated, corrupted, not safetensors at all
            raise DrafterError(f"{f} is not a readable safetensors file (truncated or corrupted? {err})") from None
    return state


def read_config(folder: str | Path, what: str = "drafter") -> dict:
    """The folder's config.json as a dict; a missing file, or one that is not a JSON object, is a one-line error."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no {what} at {folder} (config.json missing)")
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise DrafterError(f"{path} is not valid JSON ({err})") from None
    if not isinstance(raw, dict):
        raise DrafterError(f"{path} holds no JSON object")
    return raw


def parse_config(build, raw: dict, folder: str | Path):
    """build(raw): a config dataclass; a missing field, or one of the wrong type (an int field, nested configs
    included, that holds no int), is a one-line error naming the file."""
    where = Path(folder) / "config.json"
    try:
        config = build(raw)
    except (KeyError, TypeError, ValueError) as err:
        if isinstance(err, DrafterError):
            raise DrafterError(f"{where}: {err}") from None
        kind = "missing field" if isinstance(err, KeyError) else "wrong field"
        raise DrafterError(f"{where}: {kind} ({err})") from None
    _check_types(config, where)
    return config


def _check_types(config, where: Path) -> None:
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if dataclasses.is_dataclass(value):
            _check_types(value, where)
        elif f.type in ("int", int) and (not isinstance(value, int) or isinstance(value, bool)):
            raise DrafterError(f"{where}: wrong field ({f.name} must be an integer, got {value!r})")
        elif f.type in ("float", float) and not isinstance(value, (int, float)):
            raise DrafterError(f"{where}: wrong field ({f.name} must be a number, got {value!r})")


def load_strict(model: nn.Module, state: dict[str, torch.Tensor], where: str) -> None:
    """load_state_dict that names what does not match (missing, unexpected or misshapen keys) and refuses it."""
    own = model.state_dict()
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    misshapen = [k for k in own if k in state and state[k].shape != own[k].shape]
    if missing or unexpected or misshapen:
        raise DrafterError(f"the weights of {where} do not match the model: missing {missing[:4]}, unexpected "
                           f"{unexpected[:4]}, other shapes {misshapen[:4]}")
    model.load_state_dict(state)


def weights_digest(folder: str | Path) -> str:
    """sha256 over a checkpoint's safetensors files (sorted by name)."""
    digest = hashlib.sha256()
    for f in sorted(Path(folder).glob("*.safetensors")):
        digest.update(f.read_bytes())
    return digest.hexdigest()
