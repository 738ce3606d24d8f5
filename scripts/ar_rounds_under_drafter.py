"""Does a plain AR round cost more under a drafting method than under `ar`? ddtree with `--budget auto`, its policy
forced to AR steps, against `ar`, interleaved on the same prompts (the command line's defaults; alone on the
machine). What a drafting method loses at ~100 % AR rounds is then its drafting rounds, not its AR rounds.

    python scripts/ar_rounds_under_drafter.py
"""

from __future__ import annotations

import statistics

from treeflash import Target, generate
from treeflash.drafters import make_drafter
from treeflash.eval.datasets import load_prompts
from treeflash.speculation import Policy


def main(dataset: str = "gsm8k", prompts: int = 4, repeats: int = 6) -> None:
    target = Target.load(dtype="auto", compile="auto")
    ids = [target.encode_prompt(t) for t in load_prompts(dataset, limit=prompts)]
    drafters = {"ar": make_drafter("ar", target), "ddtree auto, AR rounds only": make_drafter("ddtree", target)}
    Policy.should_draft = lambda self: False  # every round a plain AR step (the taps and bookkeeping stay)
    for d in drafters.values():
        generate(target, d, ids[0], 16)
    per_round = {name: [] for name in drafters}
    for _ in range(repeats):
        for name, d in drafters.items():
            for p in ids:
                r = generate(target, d, p, 128)
                per_round[name].append(sum(x.draft_s + x.verify_s for x in r.rounds) / len(r.rounds))
    base = statistics.median(per_round["ar"])
    for name, times in per_round.items():
        print(f"{name:30s} {1e3 * statistics.median(times):.3f} ms a round  {statistics.median(times) / base:.4f}x")


if __name__ == "__main__":
    main()
