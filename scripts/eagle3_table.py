"""The table of scripts/eagle3_table.sh: tau (T = 0) or E[tau] (T = 1) per domain and budget of the EAGLE-3 drafter
beside the shipped drafters' methods, from OUT_DIR/eagle3-D-T{t}.json and OUT_DIR/shipped-METHOD-D-T{t}.json, one
method per file, each on its own rounds (markdown on stdout). With EQUAL_DIR (scripts/eagle3_equal_compute.sh), also
the DFlash drafter trained for EAGLE-3's CPU seconds: EQUAL_DIR/equal-METHOD-D-T{t}.json. With SPEED_DIR
(scripts/eagle3_speed.sh), the speed of each method with `--budget auto` against `ar` in the same run.

    python scripts/eagle3_table.py [OUT_DIR [EQUAL_DIR [SPEED_DIR]]]      # docs/results/eagle3/eval
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from treeflash.eval.datasets import DOMAINS

METHODS = ("dflash", "ddtree", "treeflash", "tfm", "eagle3")
EQUAL = ("dflash", "ddtree", "treeflash", "tfm")  # the equal-compute arm's methods (those it has run)


def read(path: Path, budget: int, prefix: str = "") -> dict[str, float]:
    """E[tau] per method at one budget of a paired report (one budget per name: 'ddtree@16'); {} if absent."""
    taus = {}
    if path.is_file():
        for name, m in json.loads(path.read_text())["methods"].items():
            method, _, b = name.partition("@")
            if b == str(budget):
                taus[prefix + method] = m["expected_tau"]
    return taus


def main(out: Path, equal: Path | None = None) -> None:
    columns = list(METHODS) + ([f"equal {m}" for m in EQUAL] if equal else [])
    for t in (0, 1):
        for budget in (16, 64):
            print(f"\nT = {t} ({'tau' if t == 0 else 'E[tau]'}), B = {budget}\n")
            ratios = ["eagle3 / best shipped"] + (["eagle3 / equal ddtree", "eagle3 / best equal"] if equal else [])
            print("| domain | " + " | ".join(columns + ratios) + " |")
            print("|---|" + "---|" * (len(columns) + len(ratios)))
            for domain in DOMAINS:
                taus = read(out / f"eagle3-{domain}-T{t}.json", budget)
                for m in METHODS[:-1]:
                    taus |= read(out / f"shipped-{m}-{domain}-T{t}.json", budget)
                for m in EQUAL if equal else ():
                    taus |= read(equal / f"equal-{m}-{domain}-T{t}.json", budget, "equal ")
                cells = [f"{taus[c]:.3f}" if c in taus else "-" for c in columns]
                shipped = [taus[m] for m in METHODS[:-1] if m in taus]
                e3 = taus.get("eagle3")
                cells.append(f"{e3 / max(shipped):.3f}x" if e3 and shipped else "-")
                if equal:
                    eq = taus.get("equal ddtree")
                    best = max((taus[f"equal {m}"] for m in EQUAL if f"equal {m}" in taus), default=None)
                    cells += [f"{e3 / eq:.3f}x" if e3 and eq else "-", f"{e3 / best:.3f}x" if e3 and best else "-"]
                print(f"| {domain} | " + " | ".join(cells) + " |")


def speed(folder: Path) -> None:
    """tokens/s against `ar` of the same run and the share of plain AR rounds, per method at
    --budget auto, from folder/{shipped,eagle3,equal}/bench-D-T{t}.json (one bench run per drafter: `ar` is in
    each, and each ratio is against its own run's)."""
    runs = {"shipped": ("dflash", "ddtree", "treeflash", "tfm"), "equal": ("dflash", "ddtree"), "eagle3": ("eagle3",)}
    columns = [(run, m) for run, methods in runs.items() if (folder / run).is_dir() for m in methods]
    names = [m if m == run else f"{run} {m}" for run, m in columns]
    for t in (0, 1):
        print(f"\nT = {t}, --budget auto: tokens/s / ar's in the same run (AR-round share)\n")
        print("| domain | ar tok/s (each run) | " + " | ".join(names) + " |")
        print("|---|---|" + "---|" * len(columns))
        for domain in DOMAINS:
            ar, cells = [], []
            for run, m in columns:
                path = folder / run / f"bench-{domain}-T{t}.json"
                if not path.is_file():
                    cells.append("-")
                    continue
                methods = json.loads(path.read_text())["methods"]
                if m == runs[run][0]:
                    ar.append(f"{methods['ar']['tokens_per_second']:.0f}")
                row = methods.get(f"{m}@auto") or methods.get(m)
                cells.append(f"{row['speedup_vs_ar']:.2f}x ({100 * row['ar_round_share']:.0f} %)" if row else "-")
            print(f"| {domain} | {' / '.join(ar) or '-'} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "docs/results/eagle3/eval"),
         Path(sys.argv[2]) if len(sys.argv) > 2 else None)
    if len(sys.argv) > 3:
        speed(Path(sys.argv[3]))
