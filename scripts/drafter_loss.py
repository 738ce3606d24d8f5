"""DFlash drafters' training loss on the answer store, per source: what a drafter has learned of each kind of answer.

Draws --per-source answers of each source and temperature (seeded), and scores every drafter given on the same
anchors (--anchors per answer, full blocks) with the training objective (`dflash_loss`, bf16 autocast as in
training, no gradients): one target forward per answer serves all drafters. Prints a table of loss, top-1 over all
depths and at depth 1 per source and drafter (each answer's means, weighted by its drafted positions), and writes it
as JSON.

The same drafter before and after a stage, on the kinds of answer it trained on and on a kind it never saw, says
what the stage taught and where (issue #30: stage 17, docs/results/training/stage17).

    .venv/bin/python scripts/drafter_loss.py src/treeflash/checkpoints/smollm2-135m-instruct-dflash \
        data/stages/smollm2-135m-instruct-dflash-stage17 [--per-source 32] [--out loss.json]
"""

import argparse
import json
import random
from collections import Counter, defaultdict

import torch
from tqdm import tqdm

from treeflash.eval.datasets import default_data_dir
from treeflash.models.dflash import DFlashDrafter
from treeflash.models.dflash_io import draft_vocab
from treeflash.runtime import Target
from treeflash.train.dflash import dflash_loss, sample_anchors, sequences, target_view
from treeflash.train.store import load_answers

FIELDS = ("loss", "acc", "acc_k1")


def kind(row: dict) -> str:
    return f"{row['id'].split('/')[0]}@T{row['temperature']:g}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("drafters", nargs="+", help="DFlash drafter folders (one draft vocabulary: the first's)")
    p.add_argument("--data", default="data/answers")
    p.add_argument("--per-source", type=int, default=32)
    p.add_argument("--anchors", type=int, default=128)
    p.add_argument("--max-len", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out")
    args = p.parse_args()

    target = Target.load("smollm2-135m-instruct", dtype="auto", quantize="none")
    target.model.requires_grad_(False)
    drafters = [DFlashDrafter.from_pretrained(d).attach(target.model).to(target.device) for d in args.drafters]
    for folder, drafter in zip(args.drafters, drafters):
        drafter.use_draft_vocab(draft_vocab(drafter, folder))
    rows = load_answers(args.data, target.encode_prompt, default_data_dir())
    by_kind = defaultdict(list)
    for r in rows:
        by_kind[kind(r)].append(r)
    rng = random.Random(args.seed)
    picked = [r for k in sorted(by_kind) for r in rng.sample(by_kind[k], min(args.per_source, len(by_kind[k])))]
    items = [(kind(r), s) for r in picked for s in sequences([r], args.max_len, drafters[0].config.block_size)]
    answers = Counter(k for k, _ in items)
    taps, vocab = drafters[0].config.target_layer_ids, drafters[0].draft_vocab
    sums = defaultdict(lambda: defaultdict(float))  # (kind, drafter) -> field -> token-weighted sum
    autocast = torch.autocast(target.device.type, dtype=torch.bfloat16)  # around the drafter only, as in training
    with torch.no_grad():
        for i, (k, seq) in enumerate(tqdm(items, desc="answers")):
            view = target_view(target.model, seq.tokens, taps, vocab)
            anchors = sample_anchors(seq, args.anchors, torch.Generator().manual_seed(args.seed * 100_003 + i))
            for d, drafter in enumerate(drafters):
                with autocast:
                    _, stats = dflash_loss(drafter, seq, view, anchors)
                n = float(stats["tokens"])
                for f in FIELDS:
                    sums[k, d][f] += float(stats[f]) * n
                sums[k, d]["tokens"] += n

    table = {k: [{f: sums[k, d][f] / sums[k, d]["tokens"] for f in FIELDS} | {"answers": answers[k]}
                 for d in range(len(drafters))] for k in sorted(answers)}
    print("| source | answers | " + " | ".join(f"{f} ({d + 1})" for d in range(len(drafters)) for f in FIELDS) + " |")
    print("|---" * (2 + len(drafters) * len(FIELDS)) + "|")
    for k, cols in table.items():
        print(f"| {k} | {cols[0]['answers']} | " + " | ".join(f"{c[f]:.3f}" for c in cols for f in FIELDS) + " |")
    for d, folder in enumerate(args.drafters):
        print(f"({d + 1}) {folder}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"drafters": args.drafters, "args": vars(args), "by_source": table}, f, indent=1)


if __name__ == "__main__":
    main()
