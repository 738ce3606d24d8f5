"""A training run's learning curve as a markdown table, as the model cards give it: at every `--every`th step,
the drafted positions so far and the means of the logged fields over the `--window` steps before it.

    .venv/bin/python scripts/learning_curve.py runs/s11/dflash/log.jsonl [--fields loss,acc,acc_k1,outside]

Fields: `loss`, `acc` (top-1 over all depths), `acc_k1` (depth 1), `outside` (the target's mass outside the draft
vocabulary); a Weaver's log also has `acc_dflash` and `in_candidates`.
"""

import argparse
import json
from statistics import mean


def curve(rows: list[dict], fields: list[str], every: int, window: int) -> list[list]:
    out = []
    for step in range(every, rows[-1]["step"] + 1, every):
        last = [r for r in rows if step - window < r["step"] <= step]
        at = [r for r in rows if r["step"] == step]
        if last and at:
            out.append([step, at[0]["positions"]] + [mean(r[f] for r in last) for f in fields])
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("log", help="a run's log.jsonl")
    p.add_argument("--fields", default="loss,acc,acc_k1,outside")
    p.add_argument("--every", type=int, default=100)
    p.add_argument("--window", type=int, default=50)
    args = p.parse_args()
    rows = [json.loads(line) for line in open(args.log)]
    fields = args.fields.split(",")
    print("| step | drafted positions | " + " | ".join(fields) + " |")
    print("|---" * (len(fields) + 2) + "|")
    for step, positions, *values in curve(rows, fields, args.every, args.window):
        print(f"| {step} | {positions:,} | " + " | ".join(f"{v:.3f}" for v in values) + " |")


if __name__ == "__main__":
    main()
