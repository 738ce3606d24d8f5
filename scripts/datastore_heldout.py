"""How often retrieval drafts are right on answers the datastore never saw (docs/results/rest).

Holds out --held greedy answers per source from the answer store and builds a Datastore of the others. At every
position of each held-out answer it drafts a tree of B nodes three ways: prompt lookup over the answer so far (pld),
the datastore alone, and rest with the datastore where the context's longest match is shorter than 1, 2 or 3
tokens (`trust_ngram`; 2 is rest's default), and
counts the drafted tokens the answer confirms along the tree (what greedy verification would accept). No target
forward: the answers are the target's own greedy tokens, and the context is the prompt (read back by id from the
prompt sets, in the target's chat template) and the answer so far, as in decoding.

    .venv/bin/python scripts/datastore_heldout.py [--held 60] [--out docs/results/rest/heldout.json]
"""

import argparse
import collections
import json
import random

from treeflash.drafters.datastore import Datastore
from treeflash.eval.datasets import default_data_dir
from treeflash.runtime import Target
from treeflash.train.data import training_prompts
from treeflash.drafters.pld import PromptLookupDrafter, vote_tree
from treeflash.train.store import AnswerStore

BUDGETS = (1, 2, 4, 8)


def confirmed(tree, truth: list[int]) -> int:
    """Drafted tokens accepted by a target whose next tokens are `truth`: the walk down the matching children."""
    children, node, n = tree.children(), 0, 0
    for token in truth:
        node = children[node].get(token)
        if node is None:
            break
        n += 1
    return n


class DatastoreAlone:
    """rest's datastore drafts without the context's."""

    def __init__(self, datastore: Datastore):
        self.datastore = datastore

    def propose(self, tokens, features, budget):
        n, paths = self.datastore.continuations(tokens)
        return vote_tree(tokens[-1], paths, budget, [n / self.datastore.ngram] * len(paths))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="data/answers")
    p.add_argument("--held", type=int, default=60, help="answers held out per source")
    p.add_argument("--vocab-size", type=int, default=49152)
    p.add_argument("--data-dir", default=None, help="the prompt sets (../shared/data)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    answers = [a for a in AnswerStore(args.data).answers() if a.temperature == 0]
    by_source = collections.defaultdict(list)
    for a in answers:
        by_source[a.id.split("/")[0]].append(a)
    rng = random.Random(0)
    held = {s: rng.sample(v, min(args.held, len(v))) for s, v in sorted(by_source.items())}
    held_ids = {a.id for v in held.values() for a in v}
    datastore = Datastore.from_sequences([a.response_ids for a in answers if a.id not in held_ids], args.vocab_size)
    texts = dict(training_prompts(args.data_dir or default_data_dir(), sorted(held)))
    encode = Target.load(dtype="bfloat16").encode_prompt  # (only its tokenizer and chat template)
    drafters = {"pld": PromptLookupDrafter(), "datastore": DatastoreAlone(datastore),
                **{f"rest-trust{k}": PromptLookupDrafter(datastore=datastore, trust_ngram=k) for k in (1, 2, 3)}}
    report = {"datastore_tokens": len(datastore), "held_per_source": args.held, "by_source": {}}
    for source, chosen in held.items():
        sums, positions = collections.defaultdict(int), 0
        for a in chosen:
            prompt, t = encode(texts[a.id]), a.response_ids
            for i in range(len(t) - 1):
                positions += 1
                context = prompt + t[:i + 1]
                for name, drafter in drafters.items():
                    for b in BUDGETS:
                        sums[name, b] += confirmed(drafter.propose(context, None, b), t[i + 1:i + 1 + b])
        row = {f"{name}@{b}": sums[name, b] / positions for name in drafters for b in BUDGETS}
        report["by_source"][source] = {"positions": positions, **row}
        print(source, positions, " ".join(f"{k} {v:.3f}" for k, v in row.items()), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
