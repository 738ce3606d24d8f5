"""`treeflash train` and `treeflash export`."""

from __future__ import annotations

import json


def cmd_export(args) -> None:
    from ..models.export import export_drafter

    summary = export_drafter(args.drafter, args.to, args.target)
    print(json.dumps(summary, indent=2))


def cmd_train(args) -> None:
    from dataclasses import fields

    if args.train_command == "average":  # no training: the trainers need not be imported
        from ..train.average import average_checkpoints

        print(json.dumps(average_checkpoints(args.folders, args.out, args.weights)))
        return
    from ..train import dflash, dflash2, eagle3, weaver
    from ..train.config import RUNS

    kind = RUNS[args.train_command]
    run = kind(**{f.name: getattr(args, f.name) for f in fields(kind)})
    trainer = {"weaver": weaver, "dflash2": dflash2, "eagle3": eagle3}.get(run.kind, dflash)
    print(json.dumps(trainer.run(run)))
