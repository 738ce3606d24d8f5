"""The `treeflash` command line: generate, serve, bench, paired, overhead, dist, gdn-bench, data, export, train.

One module per command group (`decode`, `data`, `train`) and the parser (`args`); each command turns its
arguments into calls of the library."""

from __future__ import annotations

import logging
import os
import sys

from .args import UsageError, build_parser
from .data import cmd_data
from .decode import (available_methods, cmd_bench, cmd_dist, cmd_gdn_bench, cmd_generate, cmd_overhead,
                     cmd_paired, cmd_serve)
from .train import cmd_export, cmd_train

__all__ = ["main", "available_methods", "build_parser", "UsageError"]


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        args = build_parser().parse_args(argv)
        args.command_line = ["treeflash", *(sys.argv[1:] if argv is None else argv)]  # what the manifests record
        _quiet_libraries()
        status = {"generate": cmd_generate, "serve": cmd_serve, "bench": cmd_bench, "paired": cmd_paired,
                  "overhead": cmd_overhead, "gdn-bench": cmd_gdn_bench, "dist": cmd_dist, "data": cmd_data,
                  "export": cmd_export, "train": cmd_train}[args.command](args)
    except KeyboardInterrupt:
        print("treeflash: interrupted", file=sys.stderr)
        return 130
    except Exception as err:  # user-caused errors: one line, no traceback
        from ..eval.datasets import DatasetError
        from ..models.checkpoint import DrafterError
        from ..runtime import TargetError

        if not isinstance(err, (UsageError, DatasetError, DrafterError, TargetError, OSError)):
            raise
        print(f"treeflash: error: {err}", file=sys.stderr)
        return 2
    return status or 0  # a command returns 1 when what it checked failed


def _quiet_libraries() -> None:
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    logging.basicConfig(level=logging.WARNING, format="treeflash: %(message)s")
