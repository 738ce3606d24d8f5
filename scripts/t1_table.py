"""Print the T = 1 E[tau] table of two runs of scripts/shipped_t1.sh (OLD and NEW folders of M-D-T1.json), markdown.

    python scripts/t1_table.py OLD NEW [OLD_NAME NEW_NAME]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from treeflash.eval.datasets import DOMAINS

METHODS = ("dflash", "ddtree", "treeflash", "tfm")


def tau(folder: Path, method: str, domain: str) -> float:
    (row,) = json.loads((folder / f"{method}-{domain}-T1.json").read_text())["methods"].values()
    return row["expected_tau"]


def main(old: str, new: str, old_name: str = "old", new_name: str = "new") -> None:
    print("| domain | " + " | ".join(f"{m} {n}" for m in METHODS for n in (old_name, new_name)) + " |")
    print("|---|" + "---|" * 2 * len(METHODS))
    ahead = 0
    for d in DOMAINS:
        cells = [(tau(Path(old), m, d), tau(Path(new), m, d)) for m in METHODS]
        ahead += sum(b > a for a, b in cells)
        print(f"| {d} | " + " | ".join(f"{a:.3f} | {b:.3f}" for a, b in cells) + " |")
    print(f"\n{new_name} ahead in {ahead} of {len(DOMAINS) * len(METHODS)} cells")


if __name__ == "__main__":
    main(*sys.argv[1:])
