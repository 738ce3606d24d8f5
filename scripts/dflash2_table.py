"""The table of scripts/dflash2_equal_compute.sh: expected tau per domain and temperature of each arm's methods and
the shipped drafters', from RUN_DIR/eval/{dflash2,dflash,shipped}-D-T{t}.json (markdown on stdout). A shipped
dflash / ddtree cell not measured there comes from the stage-2 evaluation of the same weights (marked †), a
treeflash / tfm one from the stage-2 evaluation of the adapters' run weights before their bf16 export (‡).

    python scripts/dflash2_table.py [RUN_DIR]      # runs/eq
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from treeflash.eval.datasets import DOMAINS

# the shipped DFlash drafter is stage 2's: its tau at T = 0, measured when it shipped
STAGE2 = Path("docs/results/training/stage2")
COLUMNS = (("shipped", "dflash"), ("shipped", "ddtree"), ("shipped", "treeflash"), ("shipped", "tfm"),
           ("dflash", "dflash"), ("dflash", "ddtree"), ("dflash2", "dflash2"), ("dflash2", "dflash2-tree"))


def main(run: Path) -> None:
    head = ["shipped " + m if arm == "shipped" else f"{arm} arm: {m}" for arm, m in COLUMNS]
    for t in (0, 1):
        print(f"\nT = {t} ({'tau' if t == 0 else 'E[tau]'}, B = 16)\n")
        print("| domain | " + " | ".join(head) + " |")
        print("|---|" + "---|" * len(head))
        for domain in DOMAINS:
            cells = []
            for arm, method in COLUMNS:
                path = run / "eval" / f"{arm}-{domain}-T{t}.json"
                mark = ""
                if not path.is_file() and arm == "shipped" and t == 0 and method in ("dflash", "ddtree"):
                    path, mark = STAGE2 / f"new-{domain}.json", " †"  # the same command on the same weights
                elif not path.is_file() and arm == "shipped" and t == 0:  # the adapters' run weights, before export
                    prefix = "tf" if method == "treeflash" else "tfm"
                    path, mark = STAGE2 / "adapters" / f"{prefix}-new-{domain}.json", " ‡"
                methods = json.loads(path.read_text())["methods"] if path.is_file() else {}
                cells.append(f"{methods[method]['expected_tau']:.3f}{mark}" if method in methods else "-")
            print(f"| {domain} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "runs/eq"))
