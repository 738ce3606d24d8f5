"""The cost-aware policy of an earlier commit against this checkout's, in one process: every method decodes with
both policies (each on its own drafter instance, so neither policy sees the other's rounds) and with `ar`,
prompt by prompt interleaved, on the default target as the command line runs it (bf16, the GGUF's blocks,
compiled), `--budget auto`.

    .venv/bin/python scripts/policy_ab.py --old 0b1d999 --dataset gsm8k --methods treeflash,tfm,dflash [--out ab.json]
"""

import argparse
import importlib.util
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from treeflash import Target, generate
from treeflash.drafters import make_drafter
from treeflash.engine import DEFAULT_MAX_BUDGET
from treeflash.eval.datasets import load_prompts
from treeflash.speculation import policy_for
from treeflash.verify import Sampling


def old_policy_class(rev: str):
    """`speculation.Policy` as it was at git revision `rev`."""
    source = subprocess.run(["git", "show", f"{rev}:src/treeflash/speculation.py"], capture_output=True, text=True,
                            check=True).stdout
    path = Path(tempfile.mkdtemp()) / "old_speculation.py"
    path.write_text(source.replace("from .", "from treeflash."))
    spec = importlib.util.spec_from_file_location("old_speculation", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["old_speculation"] = module
    spec.loader.exec_module(module)
    if hasattr(module.Policy, "adapter_pays"):
        return module.Policy
    # before the policy chose the build: every drafting round ran the drafter's adapter
    return type("Policy", (module.Policy,), {"adapter_pays": lambda self, reach: True,
                                             "observe_build": lambda self, adapter, reach, seconds: None})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--old", required=True, help="the git revision whose policy is the baseline")
    p.add_argument("--dataset", default="gsm8k")
    p.add_argument("--methods", default="treeflash,tfm,dflash")
    p.add_argument("--limit", type=int, default=10)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    target = Target.load(dtype="bfloat16", compile="on")
    prompts = [target.encode_prompt(text) for text in load_prompts(args.dataset, limit=args.limit)]
    OldPolicy = old_policy_class(args.old)
    engines = {"ar": make_drafter("ar", target)}
    for method in args.methods.split(","):
        engines[f"{method}/new"] = make_drafter(method, target)
        engines[f"{method}/old"] = old = make_drafter(method, target)
        policy_for(target, engines[f"{method}/new"], DEFAULT_MAX_BUDGET)  # measures the target's costs once
        policy_for(target, old, DEFAULT_MAX_BUDGET, policy_class=OldPolicy)  # the same costs, the old rules
    sampling = Sampling(temperature=args.temperature)
    for name, drafter in engines.items():  # warm-up: lazy initialisation and the first drafting call
        generate(target, drafter, prompts[0], 8, sampling, seed=0)
    tokens = {name: 0 for name in engines}
    seconds = {name: 0.0 for name in engines}
    rounds = {name: [0, 0, 0] for name in engines}  # rounds, drafted rounds, drafted rounds with an adapter call
    for repeat in range(args.repeats):
        for i, prompt in enumerate(prompts):
            for name, drafter in engines.items():
                out = generate(target, drafter, prompt, args.max_new_tokens, sampling, seed=i + repeat * len(prompts))
                tokens[name] += len(out.tokens)
                seconds[name] += out.seconds
                counts = (len(out.rounds), sum(r.drafted for r in out.rounds),
                          sum(r.adapter_calls > 0 for r in out.rounds))
                rounds[name] = [total + n for total, n in zip(rounds[name], counts)]
    rate = {name: tokens[name] / seconds[name] for name in engines}
    drafted = {name: n[1] / max(n[0], 1) for name, n in rounds.items()}
    adapted = {name: n[2] / max(n[1], 1) for name, n in rounds.items()}
    report = {"old": args.old, "dataset": args.dataset, "temperature": args.temperature, "prompts": len(prompts),
              "repeats": args.repeats, "tokens_per_second": rate,
              "vs_ar": {name: rate[name] / rate["ar"] for name in engines},
              "drafted_share": drafted, "adapter_share_of_drafted": adapted}
    for name in engines:
        print(f"{name:<16} {rate[name]:8.2f} tok/s  {report['vs_ar'][name]:.3f}x ar  drafted {drafted[name]:6.1%}"
              f"  with the adapter {adapted[name]:6.1%}")
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
