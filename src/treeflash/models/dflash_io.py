"""Saving and loading DFlash / TreeFlash drafters in the published layouts: DFlash's; TreeFlash's (the backbone
under `model.`, the AR layer as `ar_approximation`); a TreeFlash AR layer saved alone against its backbone folder
(an adapter, as PEFT saves them); the deprecated learned-mask layout; and the FR-Spec token ranking saved beside."""

from __future__ import annotations

import dataclasses
import json
import os
import warnings
from pathlib import Path

import torch

from .ar_layer import from_legacy
from .checkpoint import (DrafterError, load_strict, parse_config, read_config, read_weights, save_checkpoint,
                         weights_digest)
from .dflash_config import DFlashConfig


def save_drafter(model, folder: str | Path, dtype: torch.dtype = torch.bfloat16,
                 backbone: str | Path | None = None) -> None:
    """config.json + model.safetensors, in the published layouts: DFlash's, and TreeFlash's where it can express
    the AR layer (see ar_layer.py). With `backbone` (the DFlash drafter folder this TreeFlash drafter was trained
    on, frozen), only the AR layer is saved, and the config points to the backbone (relative path, and the hash of
    its weights, checked on load)."""
    state = model.state_dict()
    if backbone is None and model.ar_layer is not None and model.config.published_treeflash:
        published = {k.replace("ar_layer.", "ar_approximation.", 1) if k.startswith("ar_layer.")
                     else "model." + k: v for k, v in state.items()}
        return save_checkpoint(published, model.config.to_json(), folder, dtype)
    if backbone is None:  # DFlash, or a TreeFlash drafter the published layout cannot express
        return save_checkpoint(state, model.config.to_json(), folder, dtype)
    if model.ar_layer is None:
        raise ValueError("only a TreeFlash drafter (with an AR layer) can be saved against a backbone")
    config = model.config.to_json()
    config["treeflash_config"]["backbone"] = os.path.relpath(Path(backbone).resolve(), Path(folder).resolve())
    config["treeflash_config"]["backbone_sha256"] = weights_digest(Path(backbone))
    save_checkpoint({k: v for k, v in state.items() if k.startswith("ar_layer.")}, config, folder, dtype)


def save_dflash(model, folder: str | Path, dtype: torch.dtype = torch.bfloat16) -> None:
    """The DFlash drafter alone (of a TreeFlash drafter: its backbone), in the published DFlash format."""
    config = dataclasses.replace(model.config, ar_layer=None).to_json()
    state = {k: v for k, v in model.state_dict().items() if not k.startswith("ar_layer.")}
    save_checkpoint(state, config, folder, dtype)


def load_drafter(cls, folder: str | Path, dtype: torch.dtype = torch.float32):
    """A `cls` (DFlashDrafter) from any of the layouts `save_drafter` writes, or a published checkpoint."""
    folder = Path(folder)
    raw = read_config(folder)
    if (raw.get("treeflash_config") or {}).get("backbone") is not None:
        return _load_adapter(cls, folder, raw, dtype)
    model = cls(parse_config(DFlashConfig.from_json, raw, folder))
    if model.config.mask_token_id is None:
        _warn_learned_mask(folder)
    state = read_weights(folder)
    if any(k.startswith("model.") for k in state):  # the published TreeFlash layout: the backbone under model.
        state = {k.removeprefix("model.").replace("ar_approximation.", "ar_layer.", 1): v for k, v in state.items()}
    # published checkpoints may carry the target's embedding / head: the target's own are used instead
    state = {k: v for k, v in state.items() if not k.startswith(("embed_tokens.", "lm_head."))}
    load_strict(model, _current_ar_layer(state, state.get("norm.weight")), str(folder))
    return model.to(dtype).eval()


def _load_adapter(cls, folder: Path, raw: dict, dtype: torch.dtype):
    """A TreeFlash drafter saved as its AR layer over a DFlash backbone folder (see save_drafter)."""
    tf = raw["treeflash_config"]
    backbone = (folder / tf["backbone"]).resolve()
    if not (backbone / "config.json").is_file():
        raise DrafterError(f"the TreeFlash drafter in {folder} needs its DFlash backbone at {backbone}: not found")
    if tf.get("backbone_sha256") and tf["backbone_sha256"] != weights_digest(backbone):
        raise DrafterError(f"the DFlash backbone at {backbone} is not the one the TreeFlash drafter in {folder} "
                           "was trained on (its weights changed): retrain with `treeflash train treeflash`")
    model = load_drafter(cls, backbone, dtype=torch.float32)
    if model.ar_layer is not None:
        raise DrafterError(f"the backbone of {folder} ({backbone}) is itself a TreeFlash drafter")
    model.add_ar_layer(**DFlashConfig.from_json(raw).ar_layer)
    state = read_weights(folder)
    if not all(k.startswith("ar_layer.") for k in state):
        raise DrafterError(f"{folder} points to a backbone, so it must hold AR-layer weights only")
    state = _current_ar_layer(state, model.norm.weight.detach())
    load_strict(model.ar_layer, {k.removeprefix("ar_layer."): v for k, v in state.items()}, str(folder))
    model.backbone_folder = backbone
    return model.to(dtype).eval()


def _current_ar_layer(state: dict[str, torch.Tensor], final_norm: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """A state dict whose AR layer (`ar_layer.*`) may be in treeflash's layout before the published one: converted
    (ar_layer.from_legacy); anything else unchanged."""
    if "ar_layer.state_norm.weight" not in state:
        return state
    old = {k.removeprefix("ar_layer."): v for k, v in state.items() if k.startswith("ar_layer.")}
    rest = {k: v for k, v in state.items() if not k.startswith("ar_layer.")}
    return {**rest, **{"ar_layer." + k: v for k, v in from_legacy(old, final_norm).items()}}


def _warn_learned_mask(folder: Path) -> None:
    """The deprecation warning of the learned mask embedding, once per folder."""
    folder = folder.resolve()
    if folder in _warned:
        return
    _warned.add(folder)
    warnings.warn(f"the drafter in {folder} has a learned mask embedding instead of a mask token id: other engines "
                  "cannot load it, and treeflash will stop reading it; train it again (`treeflash train dflash` "
                  "picks a mask token)", FutureWarning, stacklevel=3)


_warned: set[Path] = set()

RANKING_FILE = "token_ranking.json"


def draft_vocab(model, folder: str | Path, size: int | None = None) -> torch.Tensor | None:
    """The `size` (default: the config's draft_vocab_size; 0: all) most frequent tokens of the ranking saved with
    the drafter in `folder` (or with its backbone); None for the whole vocabulary."""
    size = model.config.draft_vocab_size if size is None else size
    if not size or size >= model.config.vocab_size:
        return None
    for where in (Path(folder), model.backbone_folder):
        if where is not None and (where / RANKING_FILE).is_file():
            ranking = json.loads((where / RANKING_FILE).read_text())["ranking"]
            if len(ranking) < size:
                raise DrafterError(f"{where / RANKING_FILE} ranks {len(ranking)} tokens, fewer than the {size} asked")
            return torch.tensor(ranking[:size])
    raise DrafterError(f"draft vocabulary of {size} tokens asked, but no {RANKING_FILE} with the drafter in {folder}: "
                       "write one with `treeflash data rank`")
