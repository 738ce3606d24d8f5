"""`treeflash train` and `treeflash export`."""

from __future__ import annotations

import json


def cmd_export(args) -> None:
    from ..models.export import export_drafter

    summary = export_drafter(args.drafter, args.to, args.target)
    print(json.dumps(summary, indent=2))


def cmd_train(args) -> None:
    from ..runtime import default_device, native_bf16
    from ..train import dflash, dflash2, weaver

    trainer = {"weaver": weaver, "dflash2": dflash2}.get(args.train_command, dflash)
    if args.bf16 is None:  # emulated bf16 (AVX2-only CPUs) makes a step several times slower than fp32
        args.bf16 = native_bf16(default_device(args.device))
    print(json.dumps(trainer.run(args)))
