"""The table of scripts/eagle3_table.sh: tau (T = 0) or E[tau] (T = 1) per domain and budget of the EAGLE-3 drafter
beside the shipped drafters' methods, from OUT_DIR/eagle3-D-T{t}.json and OUT_DIR/shipped-METHOD-D-T{t}.json, one
method per file, each on its own rounds (markdown on stdout).

    python scripts/eagle3_table.py [OUT_DIR]      # docs/results/eagle3/eval
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

DOMAINS = ("chat-dev", "gsm8k", "humaneval", "mbpp")
METHODS = ("dflash", "ddtree", "treeflash", "tfm", "eagle3")


def main(out: Path) -> None:
    for t in (0, 1):
        for budget in (16, 64):
            print(f"\nT = {t} ({'tau' if t == 0 else 'E[tau]'}), B = {budget}\n")
            print("| domain | " + " | ".join(METHODS) + " | eagle3 / best other |")
            print("|---|" + "---|" * (len(METHODS) + 1))
            for domain in DOMAINS:
                taus = {}
                for arm in [f"shipped-{m}" for m in METHODS[:-1]] + ["eagle3"]:
                    path = out / f"{arm}-{domain}-T{t}.json"
                    if path.is_file():
                        for name, m in json.loads(path.read_text())["methods"].items():
                            method, _, b = name.partition("@")  # one budget per name: 'ddtree@16'
                            if b == str(budget):
                                taus[method] = m["expected_tau"]
                cells = [f"{taus[m]:.3f}" if m in taus else "-" for m in METHODS]
                others = [v for m, v in taus.items() if m != "eagle3"]
                ratio = f"{taus['eagle3'] / max(others):.3f}x" if "eagle3" in taus and others else "-"
                print(f"| {domain} | " + " | ".join(cells) + f" | {ratio} |")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "docs/results/eagle3/eval"))
