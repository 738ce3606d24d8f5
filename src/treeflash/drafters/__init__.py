"""Decoding methods, each a drafter behind one interface (see base.Drafter)."""

from __future__ import annotations

from .ar import AutoregressiveDrafter
from .base import Drafter
from .pld import PromptLookupDrafter

METHODS = {"ar": AutoregressiveDrafter, "pld": PromptLookupDrafter}


def make_drafter(name: str, target=None) -> Drafter:
    """The drafter for method `name`; `target` is the verifying Target (drafters that read it need it)."""
    if name not in METHODS:
        raise KeyError(f"unknown method {name!r}; choose from {', '.join(METHODS)}")
    return METHODS[name]()


__all__ = ["METHODS", "AutoregressiveDrafter", "Drafter", "PromptLookupDrafter", "make_drafter"]
