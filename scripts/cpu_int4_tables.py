"""The issue-29 summary tables from `scripts/bench_cpu_int4.sh`'s JSON files: per dataset and temperature, each
engine's tokens/s, its speedup against our `ar` and against llama.cpp's plain decoding (measured in the same run),
tau, the AR-round share and the prompts whose output equals ar's.

    .venv/bin/python scripts/cpu_int4_tables.py docs/results/cpu-int4 > docs/results/cpu-int4/tables.md
"""

import json
import sys
from pathlib import Path


def main() -> None:
    folder = Path(sys.argv[1] if len(sys.argv) > 1 else "docs/results/cpu-int4")
    for path in sorted(folder.glob("bench-*-T*.json")):
        report = json.loads(path.read_text())
        methods = report["methods"]
        llama = methods.get("llamacpp", {}).get("tokens_per_second")
        print(f"\n### {report['dataset']}, T = {report['temperature']:g} ({report['num_prompts']} prompts, "
              f"{report['max_new_tokens']} new tokens; peak RSS {report.get('max_rss_mib', float('nan')):.0f} MiB)\n")
        print("| engine | tok/s | vs ar (90 % CI) | vs llama.cpp | tau | AR rounds | mean size | dr draft ms | "
              "dr verify ms | prompts = ar |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for name, m in methods.items():
            if "skipped" in m:
                print(f"| {name} | skipped: {m['skipped']} |||||||||")
                continue
            lo, hi = m["speedup_vs_ar_interval"]
            ours = m["method"] not in ("hf", "hf-pld", "llamacpp", "llamacpp-pld")
            vs_llama = f"{m['tokens_per_second'] / llama:.2f}x" if llama else "-"
            same = m["prompts_matching_ar"]
            same = "-" if same is None else f"{same}/{report['num_prompts']}"
            print(f"| {name} | {m['tokens_per_second']:.1f} | {m['speedup_vs_ar']:.2f}x ({lo:.2f}-{hi:.2f}) | "
                  f"{vs_llama} | {m['tau']:.2f} | "
                  + (f"{100 * m['ar_round_share']:.0f} % | {m['mean_tree_size']:.1f} | "
                     f"{m['draft_ms_per_drafting_round']:.1f} | {m['verify_ms_per_drafting_round']:.1f}" if ours
                     else "- | - | - | -")
                  + f" | {same} |")


if __name__ == "__main__":
    main()
