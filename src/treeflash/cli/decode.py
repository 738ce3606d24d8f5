"""Commands that decode: generate, serve, bench, paired, overhead, dist, gdn-bench."""

from __future__ import annotations

import json
import os
import sys
import time

from .args import UsageError


def _sampling(args):
    from ..verify import Sampling

    try:
        return Sampling(args.temperature, args.top_k, args.top_p)
    except ValueError as err:
        raise UsageError(str(err)) from None


def _load_target(args):
    from ..engine import default_max_budget
    from ..runtime import Target

    target = Target.load(args.target, dtype=args.dtype, device=args.device, runtime=getattr(args, "runtime", "auto"),
                         quantize=getattr(args, "quantize", "auto"), compile=getattr(args, "compile", "off"))
    if getattr(args, "max_budget", 0) is None:  # the device's default
        args.max_budget = default_max_budget(target.device)
    return target


def _max_rss_mib() -> float:
    """This process's peak resident memory (the target, drafters and stock baselines; not llama.cpp's process)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _weights(target):
    """The target's weights for a JSON report: "dense", or what a GGUF's quantised tensors became."""
    return target.weights if isinstance(target.weights, str) else target.weights.as_dict()


def _encode(target, text: str) -> list[int]:
    if not text.strip():
        raise UsageError("the prompt is empty")
    ids = target.encode_prompt(text)
    if len(ids) >= target.context_length:
        raise UsageError(f"the prompt has {len(ids)} tokens; the target's context holds {target.context_length}")
    return ids


def cmd_generate(args) -> None:
    from ..drafters import make_drafter
    from ..engine import generate

    sampling = _sampling(args)
    if not args.prompt.strip():
        raise UsageError("the prompt is empty")
    _choose_method(args)
    target = _load_target(args)
    prompt = _encode(target, args.prompt)
    emitted: list[int] = []
    printed = ""

    def stream(token: int) -> None:  # decode the whole text each time: multi-token characters print once whole
        nonlocal printed
        emitted.append(token)
        text = target.decode(emitted)
        if text.startswith(printed) and not text.endswith("\ufffd"):
            sys.stdout.write(text[len(printed):])
            sys.stdout.flush()
            printed = text

    drafter = make_drafter(args.method, target, args.drafter, args.weaver, args.tfm_width, args.draft_vocab,
                           args.datastore)
    result = generate(target, drafter, prompt, args.max_new_tokens, sampling, args.budget, seed=args.seed,
                      on_token=None if args.json else stream, max_budget=args.max_budget)
    if args.json:
        print(json.dumps({
            "target": args.target, "method": args.method, "text": target.decode(result.tokens),
            "tokens": result.tokens, "new_tokens": len(result.tokens), "tau": result.tau,
            "tokens_per_second": len(result.tokens) / result.seconds, "rounds": len(result.rounds)}))
    else:
        rest = target.decode(result.tokens)[len(printed):]
        print(rest)
        print(f"[{args.method}: {len(result.tokens)} tokens, tau {result.tau:.2f}, "
              f"{len(result.tokens) / result.seconds:.1f} tokens/s]", file=sys.stderr)


def cmd_serve(args) -> None:
    from ..drafters import make_drafter
    from ..serve.app import Settings, is_loopback, run

    sampling = _sampling(args)
    _choose_method(args)
    api_key = args.api_key or os.environ.get("TREEFLASH_API_KEY") or None
    if api_key is None and not is_loopback(args.host):
        print(f"treeflash: warning: serving on {args.host} without an API key: whoever reaches it can use it "
              "(set --api-key or TREEFLASH_API_KEY)", file=sys.stderr)
    target = _load_target(args)
    drafter = make_drafter(args.method, target, args.drafter, args.weaver, args.tfm_width, args.draft_vocab,
                           args.datastore)
    settings = Settings(model=args.served_model_name or args.target, method=args.method, api_key=api_key,
                        timeout=args.timeout, max_tokens=args.max_new_tokens, temperature=sampling.temperature,
                        top_p=sampling.top_p, top_k=sampling.top_k, seed=args.seed)
    run(target, drafter, settings, args.budget, args.max_budget, args.max_queue, args.host, args.port,
        args.max_batch)


# --method left out, by device: the fastest method measured there. On a CPU, prompt lookup: with the 4-bit target its
# rounds cost almost nothing, and the block drafters' cost an AR step or more, so cost-aware speculation runs them
# at about ar's speed; rest (prompt lookup with a datastore) is faster on code and math (1.24-1.40x ar against
# 1.14-1.19x) but not reliably on chat (1.04x against 1.13x, docs/results/rest); on a GPU a tree verifies for
# little more than one token
DEFAULT_METHODS = {"cpu": ("pld",), "cuda": ("treeflash", "ddtree", "dflash2-tree", "pld")}


def _choose_method(args) -> None:
    """--method left out: the fastest method available for the target on the device at hand."""
    if args.method is None:
        import torch

        available = available_methods(args.target, args.drafter, args.weaver, args.datastore)
        device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu")).type
        args.method = next(m for m in DEFAULT_METHODS.get(device, DEFAULT_METHODS["cuda"]) if m in available)
    if args.method == "tfm":
        _require_weaver(args)


def _require_weaver(args) -> None:
    from ..drafters.load import default_weaver_path

    if not (args.weaver or default_weaver_path(args.target, args.drafter)):
        raise UsageError("method tfm needs --weaver PATH (a folder written by `treeflash train weaver` on the "
                         "drafter in use)")


def available_methods(target: str, drafter: str | None, weaver: str | None = None,
                      datastore: str | None = None) -> list[str]:
    """The methods that can run: ar, pld, rest with a datastore (named, or shipped for the target), and the block
    methods of the named drafter (else of the drafters shipped for the target): treeflash needs an AR layer, tfm a
    Weaver (named, or shipped with the shipped drafter)."""
    from pathlib import Path

    from ..drafters.load import default_weaver_path, shipped_datastore, shipped_drafter
    from ..models.dflash2 import is_dflash2
    from ..models.eagle3 import is_eagle3

    methods = ["ar", "pld"] + (["rest"] if datastore or shipped_datastore(target) else [])
    if drafter and is_dflash2(drafter):  # its own methods only: the DFlash ones cannot read its layers
        return methods + ["dflash2", "dflash2-tree"]
    if drafter and is_eagle3(drafter):
        return methods + ["eagle3"]
    if drafter or shipped_drafter(target, "dflash"):
        methods += ["dflash", "ddtree"]
    if drafter:
        config = Path(drafter, "config.json")
        has_ar_layer = config.is_file() and "treeflash_config" in json.loads(config.read_text())
    else:
        has_ar_layer = shipped_drafter(target, "treeflash") is not None
    if has_ar_layer:
        methods.append("treeflash")
    if (weaver or default_weaver_path(target, drafter)) and "ddtree" in methods:
        methods.append("tfm")
    return methods


def cmd_bench(args) -> None:
    from ..eval.bench import format_table, run_bench
    from ..eval.datasets import load_prompts

    sampling = _sampling(args)
    prompts = load_prompts(args.dataset, args.field, args.limit)
    if args.methods is None:
        args.methods = available_methods(args.target, args.drafter, args.weaver, args.datastore)
    if "tfm" in args.methods:
        _require_weaver(args)
    import torch

    target = _load_target(args)
    for p in prompts:
        _encode(target, p)
    if args.batch_size:
        return _batch_bench(args, target, prompts, sampling)
    started = time.time()
    methods = run_bench(target, prompts, args.methods, args.budget, sampling, args.max_new_tokens, args.seed,
                        progress=not args.no_progress, drafter_path=args.drafter, weaver_path=args.weaver,
                        tfm_widths=args.tfm_width, max_budget=args.max_budget, draft_vocab_size=args.draft_vocab,
                        datastore_path=args.datastore, repeats=args.repeats)
    dtype = str(target.dtype).removeprefix("torch.")
    report = {"target": args.target, "dataset": args.dataset, "num_prompts": len(prompts), "repeats": args.repeats,
              "budgets": args.budget,
              "max_budget": args.max_budget, "tfm_widths": args.tfm_width, "draft_vocab": args.draft_vocab,
              "temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p,
              "max_new_tokens": args.max_new_tokens, "dtype": dtype, "runtime": target.runtime,
              "compiled": target.compiled,
              "weights": _weights(target), "threads": torch.get_num_threads(), "max_rss_mib": _max_rss_mib(),
              "seconds": time.time() - started, "methods": methods}
    runs = f" x {args.repeats} runs" if args.repeats > 1 else ""
    print(f"{args.dataset}: {len(prompts)} prompts{runs}, budget {','.join(map(str, args.budget))} "
          f"(max {args.max_budget}), "
          f"T = {args.temperature}, {args.max_new_tokens} new tokens, target {args.target} ({dtype}, "
          f"{target.runtime} runtime{', compiled' if target.compiled else ''}, {torch.get_num_threads()} threads; "
          f"weights: {target.weights})")
    print(format_table(methods))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)


def _batch_bench(args, target, prompts, sampling) -> None:
    from ..eval.baselines import BASELINES
    from ..eval.batch_bench import format_batch_table, run_batch_bench
    from ..eval.bench import EAGER
    import torch

    if len(args.tfm_width) > 1:
        raise UsageError("--batch-size takes one --tfm-width")
    skipped = [m for m in args.methods if m in (*BASELINES, EAGER)]
    if skipped:
        print(f"not batched, skipped: {', '.join(skipped)}")
    started = time.time()
    rows = run_batch_bench(target, prompts, args.methods, args.batch_size, args.budget, sampling,
                           args.max_new_tokens, args.seed, progress=not args.no_progress, drafter_path=args.drafter,
                           weaver_path=args.weaver, tfm_width=args.tfm_width[0], max_budget=args.max_budget,
                           draft_vocab_size=args.draft_vocab, repeats=args.repeats,
                           datastore_path=args.datastore)
    dtype = str(target.dtype).removeprefix("torch.")
    print(f"{args.dataset}: {len(prompts)} prompts, batch sizes {','.join(map(str, args.batch_size))}, budget "
          f"{','.join(map(str, args.budget))} (max {args.max_budget}), T = {args.temperature}, {args.max_new_tokens} "
          f"new tokens, target {args.target} ({dtype}, {torch.get_num_threads()} threads)")
    print(format_batch_table(rows))
    if args.out:
        report = {"target": args.target, "dataset": args.dataset, "num_prompts": len(prompts),
                  "batch_sizes": args.batch_size, "budgets": args.budget, "max_budget": args.max_budget,
                  "temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p,
                  "max_new_tokens": args.max_new_tokens, "dtype": dtype, "weights": _weights(target),
                  "repeats": args.repeats, "threads": torch.get_num_threads(), "seconds": time.time() - started,
                  "variants": rows}
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)


def cmd_paired(args) -> None:
    from ..eval.datasets import load_prompts
    from ..eval.paired import format_paired, paired_drafters, run_paired

    prompts = load_prompts(args.dataset, args.field, args.limit)
    chosen = args.methods or available_methods(args.target, args.drafter, args.weaver, args.datastore)
    methods = [m for m in chosen if m != "ar"]
    if not methods:
        raise UsageError("paired compares tree builders: name at least one method other than ar")
    if "tfm" in methods:
        _require_weaver(args)
    target = _load_target(args)
    drafters = paired_drafters(target, methods, args.budget, args.tfm_width, args.drafter, args.weaver,
                               args.draft_vocab, args.datastore)
    encoded = [_encode(target, p) for p in prompts]
    report = run_paired(target, encoded, drafters, _sampling(args), args.max_new_tokens, args.seed,
                        progress=not args.no_progress)
    print(f"{args.dataset}: {len(prompts)} prompts, {report['rounds']} rounds driven by {next(iter(drafters))}, "
          f"T = {args.temperature}, {args.max_new_tokens} new tokens")
    if len(args.weaver or []) > 1:
        for i, path in enumerate(args.weaver, start=1):
            print(f"#{i}: Weaver {path}")
    print(format_paired(report))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"target": args.target, "dataset": args.dataset, "num_prompts": len(prompts),
                       "temperature": args.temperature, "max_new_tokens": args.max_new_tokens,
                       "dtype": args.dtype, "seed": args.seed, "drafter": args.drafter, "weavers": args.weaver,
                       **report}, f, indent=2)


def cmd_overhead(args) -> None:
    from ..eval.overhead import measure_overhead

    report = {"target": args.target, "dtype": args.dtype, **measure_overhead(_load_target(args), args.context,
                                                                           args.repeats)}
    if args.json:
        print(json.dumps(report))
        return
    print(f"{args.target} ({args.dtype}), cache {args.context}, {report['threads']} threads, "
          f"median of {args.repeats}")
    print(f"AR round through the engine  {report['ar_round_ms']:7.1f} ms  vs bare 1-token forward "
          f"{report['bare_forward_1_ms']:7.1f} ms  ratio {report['ar_overhead']:.3f}")
    print(f"17-node tree verify+commit  {report['tree_verify_17_ms']:7.1f} ms  vs bare 17-token forward "
          f"{report['bare_forward_17_ms']:7.1f} ms  ratio {report['tree_overhead']:.3f}")


def cmd_dist(args) -> None:
    from ..drafters.load import default_drafter_path, default_weaver_path, shipped_drafter
    from ..eval.datasets import load_prompts
    from ..eval.dist import distribution_metrics, format_table, plot
    from ..models.dflash import DFlashDrafter
    from ..models.weaver import Weaver

    prompts = load_prompts(args.dataset, args.field, args.limit)
    target = _load_target(args)
    path = args.drafter or shipped_drafter(args.target, "treeflash") or default_drafter_path(args.target, "dflash")
    drafter = DFlashDrafter.from_pretrained(path, dtype=target.model.dtype).attach(target.model).to(target.device)
    weaver, weaver_path = None, args.weaver or default_weaver_path(args.target, args.drafter)
    if weaver_path:
        weaver = Weaver.from_pretrained(weaver_path, target.model.dtype, drafter.dflash_folder(path))
        weaver = weaver.attach(drafter).to(target.device)
    report = {"target": args.target, "drafter": str(path), "weaver": weaver_path and str(weaver_path),
              "dataset": args.dataset, "num_prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
              "temperature": args.temperature, "seed": args.seed,
              "methods": distribution_metrics(target, drafter, prompts, args.max_new_tokens, not args.no_progress,
                                              weaver, args.temperature, args.seed)}
    print(format_table(report["methods"]))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)
    if args.plot:
        plot(report["methods"], args.plot)


def cmd_gdn_bench(args) -> None:
    import torch

    from ..gdn.bench import format_table, run_bench

    if args.threads:
        torch.set_num_threads(args.threads)
    result = run_bench(tuple(args.tree_size), args.heads, args.dk, args.dv, args.repeats, args.seed, args.device)
    print(json.dumps(result) if args.json else format_table(result))
