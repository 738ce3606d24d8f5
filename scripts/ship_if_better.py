"""Compare a training stage's drafters with the shipped ones, and ship them only if they win on every domain.

    python scripts/ship_if_better.py EVAL_DIR METHODS [SHIP [NEW SHIPPED]...]

EVAL_DIR/eval holds `treeflash paired` reports for each domain D: new-D.json and shipped-D.json, or one report per
method, new-D-METHOD.json and shipped-D-METHOD.json, so that each method is scored on its own rounds
(scripts/train_all.sh writes those). Prints the tau table (markdown, for the model card) and exits 0 when every
method in METHODS (commas, paired's names: ddtree@16 where a report has several budgets) has a higher expected tau
with the new drafters than with the shipped ones on every domain, 1 otherwise. With SHIP = 1 and a win, each NEW
folder replaces its SHIPPED folder (a TreeFlash adapter's backbone path is pointed at the shipped DFlash folder
beside it).
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

DOMAINS = ("chat-dev", "gsm8k", "humaneval", "mbpp")


def domain_taus(eval_dir: Path, side: str, domain: str) -> dict[str, float]:
    """Expected tau per method over every report of one side ("new" or "shipped") for one domain."""
    paths = sorted({*eval_dir.glob(f"{side}-{domain}.json"), *eval_dir.glob(f"{side}-{domain}-*.json")})
    if not paths:
        sys.exit(f"no {side}-{domain}*.json in {eval_dir}")
    taus: dict[str, float] = {}
    for path in paths:
        for method, row in json.loads(path.read_text())["methods"].items():
            if method in taus:
                sys.exit(f"{method} is in two {side}-{domain} reports: which one counts?")
            taus[method] = row["expected_tau"]
    return taus


def tau_table(eval_dir: Path, methods: list[str]) -> tuple[list[str], bool]:
    lines = ["| domain | " + " | ".join(f"{m} shipped | {m} new | new / shipped" for m in methods) + " |",
             "|---|" + "---|---|---|" * len(methods)]
    wins = True
    for domain in DOMAINS:
        new, old = domain_taus(eval_dir, "new", domain), domain_taus(eval_dir, "shipped", domain)
        cells = []
        for m in methods:
            if m not in new or m not in old:
                sys.exit(f"{m} is missing from the {domain} reports (new: {sorted(new)}, shipped: {sorted(old)})")
            a, b = old[m], new[m]
            wins &= b > a
            cells.append(f"{a:.3f} | {b:.3f} | {b / a:.3f}x")
        lines.append(f"| {domain} | " + " | ".join(cells) + " |")
    return lines, wins


def ship(new: Path, shipped: Path) -> None:
    tmp = shipped.with_name(shipped.name + ".new")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(new, tmp)
    config_path = tmp / "config.json"
    config = json.loads(config_path.read_text())
    if (config.get("treeflash_config") or {}).get("backbone"):  # an adapter: its backbone is the shipped DFlash
        config["treeflash_config"]["backbone"] = "../smollm2-135m-instruct-dflash"
        config_path.write_text(json.dumps(config, indent=2) + "\n")
    for keep in ("README.md",):  # the model card stays; its tables are updated by hand from the printed one
        if (shipped / keep).exists():
            shutil.copy(shipped / keep, tmp / keep)
    shutil.rmtree(shipped)
    tmp.rename(shipped)


def main(argv: list[str]) -> int:
    eval_dir, methods = Path(argv[0]) / "eval", argv[1].split(",")
    do_ship = len(argv) > 2 and argv[2] == "1"
    pairs = [(Path(argv[i]), Path(argv[i + 1])) for i in range(3, len(argv) - 1, 2)]
    lines, wins = tau_table(eval_dir, methods)
    print("\n".join(lines))
    print(f"new drafters {'win' if wins else 'do not win'} on every domain ({', '.join(methods)})")
    if wins and do_ship:
        for new, shipped in pairs:
            ship(new, shipped)
            print(f"shipped {new} -> {shipped}")
    return 0 if wins else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
