"""Checkpoint IO in one place: the save_pretrained layout (config.json + model.safetensors) that every treeflash
model writes, strict loading (a key that is missing or left over is an error, never silently dropped), and the
digest by which an adapter checks that it sits on the backbone it was trained on."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn


class DrafterError(ValueError):
    """A drafter checkpoint that cannot be used (unreadable, or it does not fit the target)."""


def save_checkpoint(state: dict[str, torch.Tensor], config: dict, folder: str | Path, dtype: torch.dtype) -> None:
    """The save_pretrained layout: config.json and model.safetensors (weights cast to `dtype`)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    state = {k: v.detach().to(dtype).contiguous() for k, v in state.items()}
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})


def read_weights(folder: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of the folder's *.safetensors files (sharded checkpoints included)."""
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no weights (*.safetensors) in {folder}")
    state = {}
    for f in files:
        state.update(load_file(str(f)))
    return state


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
