"""`treeflash data`: regen, magpie, rank, datastore, manifest, check, import."""

from __future__ import annotations

import json
import sys

from .args import UsageError
from .decode import _load_target


def cmd_data(args) -> None:
    import shlex
    from pathlib import Path

    from ..eval.datasets import default_data_dir
    from ..train.data import regenerate, source_commit, training_prompts
    from ..train.processes import process_share
    from ..train.store import AnswerStore, import_jsonl, stores

    if args.data_command == "rank":
        return cmd_rank(args)
    if args.data_command == "datastore":
        return cmd_datastore(args)
    if args.data_command == "manifest":
        text = json.dumps([store.summary() for store in stores(args.data)], indent=2)
        if args.out:
            Path(args.out).write_text(text + "\n")
        return print(text)
    if args.data_command == "check":
        store = stores(args.data)[0]
        problems = store.verify()
        for problem in problems:
            print(f"{store.folder}/{problem}", file=sys.stderr)
        print(json.dumps({"store": str(store.folder), "shards": len(store.entries()), "problems": len(problems)}))
        return 1 if problems else None
    if args.data_command == "import":
        return print(json.dumps({"added": import_jsonl(args.folder, AnswerStore(args.into)), "store": args.into}))

    meta = {"target": args.target, "dtype": args.dtype, "commit": source_commit(),
            "command": shlex.join(args.command_line)}
    if args.data_command == "magpie":
        from ..train.magpie import write_magpie

        process_share()  # under torchrun: this process's GPU, before the target loads onto it
        return print(json.dumps(write_magpie(_load_target(args), AnswerStore(args.out), args.count, meta,
                                             args.batch_size, args.seed, args.temperature, args.turn_tokens,
                                             args.max_new_tokens, args.shard_size)))

    data_dir = Path(args.data_dir) if args.data_dir else default_data_dir()
    prompts = training_prompts(data_dir, [s.strip() for s in args.sources.split(",") if s.strip()])
    if args.limit:
        prompts = prompts[: args.limit] if len(args.sources.split(",")) == 1 else _spread(prompts, args.limit)
    process_share()  # under torchrun: this process's GPU, before the target loads onto it
    report = regenerate(_load_target(args), prompts, AnswerStore(args.out), meta, args.max_new_tokens,
                        args.batch_size, seed=args.seed, temperature=args.temperature, shard_size=args.shard_size)
    print(json.dumps(report))


def cmd_rank(args) -> None:
    from pathlib import Path

    from ..models.dflash_io import RANKING_FILE
    from ..train.data import token_ranking
    from ..train.store import stores

    folder = Path(args.drafter)
    if not (folder / "config.json").is_file():
        raise UsageError(f"no drafter at {folder} (config.json missing)")
    ranking, stats = token_ranking([a.response_ids for store in stores(args.data) for a in store.answers()])
    (folder / RANKING_FILE).write_text(json.dumps({"data": args.data, **stats, "ranking": ranking}) + "\n")
    if args.size is not None:
        config = json.loads((folder / "config.json").read_text())
        config["draft_vocab_size"] = args.size or None
        (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    print(json.dumps({"drafter": str(folder), **stats, "draft_vocab_size": args.size}))


def cmd_datastore(args) -> None:
    import shlex
    from collections import Counter

    from ..drafters.datastore import Datastore
    from ..runtime import Target
    from ..train.data import source_commit
    from ..train.store import stores

    chosen = stores(args.data)
    others = {e.get("target") for store in chosen for e in store.entries()} - {args.target}
    if others:
        raise UsageError(f"{args.data} holds answers of {', '.join(sorted(map(str, others)))}, not of --target "
                         f"{args.target}: a datastore drafts for the target that wrote it")
    answers = [a for store in chosen for a in store.answers() if a.temperature == args.temperature]
    if not answers:
        raise UsageError(f"{args.data} holds no answers at temperature {args.temperature}")
    vocab_size = Target.load(args.target, dtype="bfloat16").config.vocab_size
    datastore = Datastore.from_sequences([a.response_ids for a in answers], vocab_size)
    info = {"target": args.target, "data": args.data, "temperature": args.temperature,
            "answers_by_source": dict(Counter(a.source for a in answers)), "commit": source_commit(),
            "command": shlex.join(args.command_line)}
    datastore.save(args.out, info)
    print(json.dumps({"datastore": args.out, "sequences": len(answers), "tokens": len(datastore),
                      "ngram": datastore.ngram}))


def _spread(items: list, n: int) -> list:
    """n items drawn evenly across the list (a limit that keeps every source)."""
    step = len(items) / n
    return [items[int(i * step)] for i in range(min(n, len(items)))]
