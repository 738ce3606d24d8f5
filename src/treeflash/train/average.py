"""Checkpoint averaging: the element-wise mean of drafters trained one from another.

Consecutive stages of one drafter lie in one basin of the loss; their mean sits nearer its centre and often scores
above each of them (stochastic weight averaging, Izmailov et al. 2018; LAWA, Kaddour et al. 2022). The folders must
be the same model: the same tensors, and every other file but a model card (config.json, the FR-Spec ranking)
byte-identical, which also keeps the averaged drafter's rows those of the folders."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..models.checkpoint import DrafterError, read_weights


def average_checkpoints(folders: list[str | Path], out: str | Path, weights: list[float] | None = None) -> dict:
    """Write the mean of `folders`' weights (computed in fp32, saved in their dtype) with their other files to `out`.

    `weights` (one per folder, normalised to sum 1) weights the mean, e.g. towards the later of two stages."""
    folders = [Path(f) for f in folders]
    if len(folders) < 2:
        raise DrafterError("averaging needs two checkpoints or more")
    weights = [1.0] * len(folders) if weights is None else [float(w) for w in weights]
    if len(weights) != len(folders) or min(weights) < 0 or sum(weights) <= 0:
        raise DrafterError(f"--weights needs one weight ≥ 0 per checkpoint ({len(folders)}), not all zero")
    shares = torch.tensor(weights, dtype=torch.float64) / sum(weights)
    if Path(out).resolve() in {f.resolve() for f in folders}:
        raise DrafterError(f"--out {out} is one of the checkpoints averaged: write the mean elsewhere")
    first, *rest = folders
    # the files that define the model besides its weights (config, FR-Spec ranking); a model card does not
    others = sorted(p.name for p in first.iterdir() if p.is_file() and p.suffix not in (".safetensors", ".md"))
    states = [read_weights(f) for f in folders]
    for folder, state in zip(rest, states[1:]):
        if state.keys() != states[0].keys():
            raise DrafterError(f"{folder} and {first} hold different tensors: not one model")
        for name in others:
            if not (folder / name).is_file() or (folder / name).read_bytes() != (first / name).read_bytes():
                raise DrafterError(f"{folder / name} differs from {first / name}: not one model")
    mean = {}
    for key, tensor in states[0].items():
        values = [s[key] for s in states]
        if any(v.shape != tensor.shape or v.dtype != tensor.dtype for v in values):
            raise DrafterError(f"tensor {key} differs in shape or dtype between the checkpoints")
        if tensor.is_floating_point():
            stacked = torch.stack([v.float() for v in values])
            mean[key] = torch.tensordot(shares.float(), stacked, dims=1).to(tensor.dtype)
        elif all(torch.equal(v, tensor) for v in values):  # e.g. an index map: equal, or it cannot be averaged
            mean[key] = tensor
        else:
            raise DrafterError(f"integer tensor {key} differs between the checkpoints: it cannot be averaged")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file(mean, str(out / "model.safetensors"), metadata={"format": "pt"})  # as save_checkpoint writes it
    for name in others:
        shutil.copyfile(first / name, out / name)
    return {"out": str(out), "averaged": [str(f) for f in folders], "weights": shares.tolist(), "tensors": len(mean)}
