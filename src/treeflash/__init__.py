"""treeflash: lossless tree speculative decoding with one-shot block drafters."""

from .engine import GenerationResult, generate
from .runtime import DEFAULT_TARGET, Target
from .tree import DraftTree
from .verify import Sampling

__all__ = ["DEFAULT_TARGET", "DraftTree", "GenerationResult", "Sampling", "Target", "generate"]
__version__ = "0.1.0"
