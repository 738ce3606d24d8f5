"""Compare a training stage's drafters with the shipped ones, and ship them only if they win on every domain.

    python scripts/ship_if_better.py [--domains] EVAL_DIR METHODS [SHIP [NEW SHIPPED]...]

EVAL_DIR/eval holds `treeflash paired` reports for each domain D: new-D.json and shipped-D.json, or one report per
method, new-D-METHOD.json and shipped-D-METHOD.json, so that each method is scored on its own rounds
(scripts/train_all.sh writes those). Prints the tau table (markdown, for the model card) and exits 0 when the new
drafters win, 1 otherwise. With SHIP = 1 and a win, each NEW folder replaces its SHIPPED folder (a TreeFlash
adapter's backbone path is pointed at the shipped DFlash folder beside it).

A win: by default every cell, each method in METHODS (commas, paired's names: ddtree@16 where a report has several
budgets) on every domain, has a higher expected tau with the new drafters. With --domains, every domain: the
geometric mean of its cells' ratios (new / shipped) is above 1, and no cell is significantly worse (the 90 %
interval of its ratio, bootstrapped over the prompts, lies below 1). Once a stage gains less than one cell's noise
(10 prompts), the first rule fails on noise alone; the second asks what "beats on every domain" says. It needs the
per-prompt sums that paired writes (`prompt_totals`, `prompt_rounds`).
"""

from __future__ import annotations

import json
import math
import random
import shutil
import sys
from pathlib import Path

from treeflash.eval.datasets import DOMAINS

RESAMPLES, LEVEL = 2000, 0.90  # the bootstrap over prompts: resamples, two-sided interval


def domain_rows(eval_dir: Path, side: str, domain: str) -> dict[str, dict]:
    """Per method, its row (expected_tau, prompt_totals) and the report's prompt_rounds, over every report of one
    side ("new" or "shipped") for one domain."""
    paths = sorted({*eval_dir.glob(f"{side}-{domain}.json"), *eval_dir.glob(f"{side}-{domain}-*.json")})
    if not paths:
        sys.exit(f"no {side}-{domain}*.json in {eval_dir}")
    rows: dict[str, dict] = {}
    for path in paths:
        report = json.loads(path.read_text())
        for method, row in report["methods"].items():
            if method in rows:
                sys.exit(f"{method} is in two {side}-{domain} reports: which one counts?")
            rows[method] = {**row, "prompt_rounds": report.get("prompt_rounds")}
    return rows


def ratio_interval(new: dict, old: dict, rng: random.Random) -> tuple[float, float]:
    """The LEVEL bootstrap interval of new / old expected tau, the prompts resampled together on both sides."""
    if new["prompt_rounds"] is None or old["prompt_rounds"] is None:
        sys.exit("--domains needs reports with per-prompt sums (prompt_rounds): rerun them with treeflash paired")
    n = len(new["prompt_rounds"])
    if len(old["prompt_rounds"]) != n:
        sys.exit("the two sides were evaluated on different prompts")

    def tau(row, picks):
        return sum(row["prompt_totals"][i] for i in picks) / sum(row["prompt_rounds"][i] for i in picks)

    ratios = sorted(tau(new, p) / tau(old, p) for p in ([rng.randrange(n) for _ in range(n)] for _ in range(RESAMPLES)))
    tail = (1 - LEVEL) / 2
    return ratios[int(tail * RESAMPLES)], ratios[int((1 - tail) * RESAMPLES) - 1]


def tau_table(eval_dir: Path, methods: list[str], by_domain: bool = False) -> tuple[list[str], bool]:
    lines = ["| domain | " + " | ".join(f"{m} shipped | {m} new | new / shipped" for m in methods)
             + (" | geometric mean |" if by_domain else " |"),
             "|---|" + "---|---|---|" * len(methods) + ("---|" if by_domain else "")]
    wins, rng = True, random.Random(0)
    for domain in DOMAINS:
        new, old = domain_rows(eval_dir, "new", domain), domain_rows(eval_dir, "shipped", domain)
        cells, ratios = [], []
        for m in methods:
            if m not in new or m not in old:
                sys.exit(f"{m} is missing from the {domain} reports (new: {sorted(new)}, shipped: {sorted(old)})")
            a, b = old[m]["expected_tau"], new[m]["expected_tau"]
            ratios.append(b / a)
            cell = f"{a:.3f} | {b:.3f} | {b / a:.3f}x"
            if by_domain:
                low, high = ratio_interval(new[m], old[m], rng)
                wins &= high >= 1
                cell += f" ({low:.3f}-{high:.3f})"
            else:
                wins &= b > a
            cells.append(cell)
        mean = math.exp(sum(map(math.log, ratios)) / len(ratios))
        if by_domain:
            wins &= mean > 1
            cells.append(f"{mean:.4f}x")
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
    by_domain = "--domains" in argv
    argv = [a for a in argv if a != "--domains"]
    if len(argv) < 2 or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv[:1] in (["-h"], ["--help"]) else 2
    eval_dir, methods = Path(argv[0]) / "eval", argv[1].split(",")
    do_ship = len(argv) > 2 and argv[2] == "1"
    pairs = [(Path(argv[i]), Path(argv[i + 1])) for i in range(3, len(argv) - 1, 2)]
    lines, wins = tau_table(eval_dir, methods, by_domain)
    print("\n".join(lines))
    rule = "domain (geometric mean above 1, no cell significantly worse)" if by_domain else "cell"
    print(f"new drafters {'win' if wins else 'do not win'} on every {rule} ({', '.join(methods)})")
    if wins and do_ship:
        for new, shipped in pairs:
            ship(new, shipped)
            print(f"shipped {new} -> {shipped}")
    return 0 if wins else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
