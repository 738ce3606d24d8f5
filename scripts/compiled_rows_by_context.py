"""Whole verify forwards of the default target on the compiled layer against the eager path (the dense copy from 6
rows on), by rows and
context length: where `static_decoder.COMPILED_ROWS` should end (docs/results/rest).

    .venv/bin/python scripts/compiled_rows_by_context.py [--out rows.json]
"""

import argparse
import json

from forward_costs import bushy, verify_ms

from treeflash import Target

ROWS = (1, 4, 6, 8, 12)
CONTEXTS = (200, 600, 1200)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    args = p.parse_args()
    target = Target.load(dtype="bfloat16", compile="on")
    static = target.static
    prompt = target.encode_prompt("Natalia sold clips to 48 of her friends in April, and then she sold half as many "
                                  "clips in May. How many clips did Natalia sell altogether?")
    rows = []
    for length in CONTEXTS:
        context = (prompt * (length // len(prompt) + 1))[:length]
        for compiled_rows, path in ((0, "eager"), (max(ROWS), "compiled")):
            static.compiled_rows = compiled_rows  # eager: the 4-bit kernel below DENSE_ROWS (6), the dense copy from it
            ms = {n: verify_ms(target, context[:-1], bushy(context[-1], n)) for n in ROWS}
            rows.append({"context": length, "path": path, "ms_by_rows": ms})
            print(length, path, " ".join(f"{n}: {v:.1f}" for n, v in ms.items()), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
