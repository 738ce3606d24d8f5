"""What cost-aware speculation spends on drafting that does not pay: one method at `--budget auto` over a
dataset's first prompts (as `bench` takes them), every drafted round logged as predicted to pay or as a probe, with
the time it lost against the plain AR steps that would have committed its tokens.

    python scripts/policy_spending.py METHOD DATASET [--limit N] [--drafter FOLDER] [--temperature T]
"""

from __future__ import annotations

import argparse

from treeflash.drafters import make_drafter
from treeflash.engine import generate
from treeflash.eval.datasets import load_prompts
from treeflash.runtime import Target
from treeflash.speculation import policy_for
from treeflash.verify import Sampling


def main(method: str, dataset: str, limit: int = 10, drafter_path: str | None = None,
         temperature: float = 0.0) -> None:
    target = Target.load(dtype="auto", compile="auto")  # the command line's defaults
    drafter = make_drafter(method, target, drafter_path)
    generate(target, drafter, target.encode_prompt("Hello"), 16)  # warm-up; makes the policy
    policy = policy_for(target, drafter, 16)
    should_draft, observe = policy.should_draft, policy.observe
    log: list[dict] = []

    def logged_should_draft() -> bool:
        drafts = should_draft()
        kind = None
        if drafts:
            kind = "pays" if policy.gain is not None and policy.gain > policy.rate * policy.draft_s else "probe"
        log.append({"kind": kind if drafts else "ar"})
        return drafts

    def logged_observe(trees, paths, committed, draft_s, verify_s, drafted, context=None):
        log[-1].update(committed=committed, seconds=draft_s + verify_s)
        return observe(trees, paths, committed, draft_s, verify_s, drafted, context)

    policy.should_draft, policy.observe = logged_should_draft, logged_observe
    sampling = Sampling(temperature=temperature)
    total = sum(generate(target, drafter, target.encode_prompt(p), 128, sampling, seed=i).seconds
                for i, p in enumerate(load_prompts(dataset, limit=limit)))
    step = policy.costs(1)
    print(f"{method} on {dataset} ({limit} prompts, 128 tokens, T = {temperature}): {len(log)} rounds, {total:.2f} s, "
          f"AR step {step * 1e3:.2f} ms")
    for kind in ("ar", "pays", "probe"):
        rounds = [r for r in log if r["kind"] == kind]
        seconds = sum(r["seconds"] for r in rounds)
        line = (f"  {kind}: {len(rounds)} rounds, {sum(r['committed'] for r in rounds)} tokens, drafting and "
                f"verifying {seconds * 1e3:.0f} ms")
        if kind != "ar":  # against the plain AR steps that would have committed its tokens
            lost = seconds - sum(r["committed"] for r in rounds) * step
            line += f", lost {lost * 1e3:.1f} ms ({lost / total:.1%} of the time)"
        print(line)
    rounds_s = sum(r["seconds"] for r in log)
    print(f"  outside drafting and verifying (prefill, acceptance, commit, policy): {(total - rounds_s) * 1e3:.0f} ms")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("method")
    p.add_argument("dataset")
    p.add_argument("--limit", type=int, default=10)
    p.add_argument("--drafter", default=None)
    p.add_argument("--temperature", type=float, default=0.0)
    args = p.parse_args()
    main(args.method, args.dataset, args.limit, args.drafter, args.temperature)
