"""The `treeflash` command line: generate, serve, bench, paired, overhead, dist, gdn-bench, data, export, train."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

from . import __version__


class UsageError(Exception):
    """A mistake in what the user asked for: reported as one line on stderr, exit status 2."""


class Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, no usage dump
        raise UsageError(message)


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def _methods(text: str, baselines: bool = False) -> list[str]:
    from .drafters import METHODS
    from .eval.baselines import BASELINES
    from .eval.bench import EAGER

    known = METHODS + BASELINES + (EAGER,) if baselines else METHODS
    names = [m.strip() for m in text.split(",") if m.strip()]
    unknown = [m for m in names if m not in known]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown method {', '.join(unknown) or repr(text)}; "
                                         f"choose from {', '.join(known)}")
    return names


def _budget(text: str) -> int | str:
    return "auto" if text.strip() == "auto" else _positive_int(text)


def _budgets(text: str) -> list:
    return [_budget(x) for x in text.split(",") if x.strip()] or [_budget(text)]


def _positive_ints(text: str) -> list[int]:
    return [_positive_int(x) for x in text.split(",") if x.strip()] or [_positive_int(text)]


def _paths(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def _add_decoding_args(p: argparse.ArgumentParser, sweep: bool = False, weavers: bool = False,
                       paired: bool = False, serve: bool = False) -> None:
    """Decoding options; with `sweep` (bench, paired), --budget and --tfm-width take comma-separated lists, with
    `weavers` (paired) --weaver too; `serve` has --default-temperature for --temperature (requests name their own)."""
    from .engine import DEFAULT_MAX_BUDGET
    from .target import DEFAULT_TARGET

    ints, several = (_positive_ints, "; a list such as 16,64 runs each") if sweep else (_positive_int, "")
    if paired:
        p.add_argument("--budget", type=_positive_ints, default=[16],
                       help="draft nodes per tree, root excluded (16; a list such as 16,64 runs each)")
    else:
        p.add_argument("--budget", type=_budgets if sweep else _budget, default=["auto"] if sweep else "auto",
                       help="draft nodes per tree, root excluded, or auto (default): each round the tree prefix "
                       "that maximises expected tokens per second, or a plain AR step when none pays"
                       + ("; a list such as auto,16,64 runs each" if sweep else ""))
        p.add_argument("--max-budget", type=_positive_int, default=DEFAULT_MAX_BUDGET,
                       help=f"the largest tree auto drafts ({DEFAULT_MAX_BUDGET})")
    if serve:
        from .serve.openai_api import DEFAULT_TEMPERATURE

        p.add_argument("--default-temperature", dest="temperature", type=float, default=DEFAULT_TEMPERATURE,
                       help=f"the temperature of requests that leave it out ({DEFAULT_TEMPERATURE:g}, OpenAI's "
                       "default; 0 = greedy)")
    else:
        p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = off)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass, in (0, 1] (1 = off)")
    p.add_argument("--max-new-tokens", type=_positive_int, default=128)
    p.add_argument("--target", default=DEFAULT_TARGET, help="Hub id, local folder or .gguf file "
                   f"(default: the embedded {DEFAULT_TARGET})")
    exact = "float32" if paired else "auto"  # paired measures tau: exact by default
    p.add_argument("--dtype", default=exact, choices=["float32", "bfloat16", "auto"],
                   help="target precision: auto (bfloat16 where the hardware multiplies it natively, else float32), "
                   "float32 (exact against AR: the tests' path) or bfloat16 (fast, but batched rounding can flip a "
                   f"near-tie); default {exact}")
    p.add_argument("--quantize", default="auto", choices=["auto", "none", "gguf", "int4"],
                   help="GGUF targets: auto (default) keeps the file's 4-bit and 8-bit tensors (Q4_0, Q4_1, Q4_K, "
                   "Q8_0) and multiplies them with PyTorch's int4 CPU kernel when the activations are bfloat16; "
                   "gguf always; none runs the dequantised weights. Other targets: int4 rounds their linears to 4 "
                   "bits (groups of 32; the model changes, speculation stays exact with respect to it)")
    p.add_argument("--runtime", default="auto", choices=["auto", "static", "hf"],
                   help="target runtime: the static-cache fast path where the architecture has one (auto), or the "
                   "generic Hugging Face forward (hf, the reference)")
    compile_default = "off" if paired else "auto"
    p.add_argument("--compile", default=compile_default, choices=["auto", "on", "off"],
                   help="compile the target's decoding layers with torch.compile (inductor, C++ wrapper): auto does "
                   "where that is fast (a 4-bit GGUF target on the CPU, with a C++ compiler; about 35 s at the first "
                   "start on 2 cores, cached after), on always, off never (eager: the reference); "
                   f"default {compile_default}")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--drafter", default=None, help="DFlash drafter folder for dflash/ddtree/tfm "
                   "(default: the one shipped for the target), or a DFlash2 folder for dflash2 / dflash2-tree (none ships)")
    p.add_argument("--weaver", type=_paths if weavers else str, default=None,
                   help="Weaver folder for tfm (written by `treeflash train weaver`; default: the one shipped for the "
                   "target)" + ("; a list A,B compares checkpoints: every tfm variant once per Weaver, named "
                                "#1, #2, ..." if weavers else ""))
    p.add_argument("--draft-vocab", type=int, default=None, metavar="N",
                   help="the drafter's LM head scores only the N most frequent tokens (FR-Spec; default: as the "
                   "drafter's config.json says; 0: every token)")
    p.add_argument("--tfm-width", type=ints, default=[8] if sweep else 8,
                   help=f"tfm: nodes expanded per Weaver call (8{several})")


def build_parser() -> Parser:
    from .drafters import METHODS
    from .target import DEFAULT_TARGET
    from .train.store import DEFAULT_STORE

    parser = Parser(prog="treeflash", description="Lossless tree speculative decoding with one-shot block drafters.")
    parser.add_argument("--version", action="version", version=f"treeflash {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)

    g = sub.add_parser("generate", help="generate text for one prompt, streamed")
    g.add_argument("prompt")
    g.add_argument("--method", default=None, choices=list(METHODS),
                   help="decoding method (default: treeflash with the shipped drafter, else ddtree, else pld)")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    _add_decoding_args(g)

    sv = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (/v1/chat/completions, /v1/completions)",
                        description="Requests that leave out max_tokens, temperature, top_p or seed get "
                        "--max-new-tokens, --default-temperature (1, as with OpenAI; 0: greedy), --top-p, and a seed "
                        "drawn from --seed.")
    sv.add_argument("--method", default=None, choices=list(METHODS),
                    help="decoding method (default: treeflash with the shipped drafter, else ddtree, else pld)")
    sv.add_argument("--host", default="127.0.0.1", help="address to listen on (127.0.0.1: this machine only)")
    sv.add_argument("--port", type=int, default=8000)
    sv.add_argument("--api-key", default=None, help="clients must send Authorization: Bearer KEY "
                    "(default: $TREEFLASH_API_KEY; unset: no key)")
    sv.add_argument("--max-queue", type=_positive_int, default=16,
                    help="requests waiting for a decoding slot; more get 429 (16)")
    sv.add_argument("--max-batch", type=_positive_int, default=1,
                    help="requests decoded together (continuous batching: a request joins between rounds when a "
                    "slot is free); 1 (default): one at a time. Needs the static runtime (llama, qwen2, qwen3)")
    sv.add_argument("--timeout", type=_positive_float, default=600.0,
                    help="seconds from a request's arrival to the end of its answer (600)")
    sv.add_argument("--served-model-name", default=None, help="the model name clients use (default: --target)")
    _add_decoding_args(sv, serve=True)

    for name, text in (("bench", "compare methods on a dataset: tau, tokens/s, speedup, exactness"),
                       ("paired", "compare tree builders on one shared continuation (driven by the first "
                                  "variant): E[tau] of every variant's tree at every round, no speed")):
        b = sub.add_parser(name, help=text)
        b.add_argument("--dataset", default="gsm8k", help="gsm8k, humaneval, mbpp (test splits), chat-dev (the ShareGPT "
                       "prompts held out from training, read from $TREEFLASH_DATA or ../shared/data) or a .jsonl file")
        b.add_argument("--field", default=None, help="prompt field of a .jsonl file "
                       "(default: the first of prompt, question, problem, text, turns)")
        b.add_argument("--limit", type=_positive_int, default=10, help="number of prompts (10)")
        b.add_argument("--methods", type=(lambda t: _methods(t, baselines=True)) if name == "bench" else _methods,
                       default=None, help=f"comma-separated ({','.join(METHODS)}"
                       + (", and the baselines hf, hf-pld, llamacpp, llamacpp-pld" if name == "bench" else "")
                       + "; default: those with a drafter shipped for the target)")
        b.add_argument("--out", default=None, help="write the results as JSON to this file")
        b.add_argument("--no-progress", action="store_true")
        if name == "bench":
            b.add_argument("--batch-size", type=_positive_ints, default=None, metavar="N[,M...]",
                           help="decode the prompts N at a time (continuous batching) and report total tokens/s "
                           "against batched ar and against batch size 1; a list such as 1,2,4,8 runs each")
            b.add_argument("--repeats", type=_positive_int, default=1,
                           help="with --batch-size: runs of the whole set per variant, interleaved (1)")
        _add_decoding_args(b, sweep=True, weavers=name == "paired", paired=name == "paired")
    o = sub.add_parser("overhead", help="engine cost on top of bare target forwards (AR round, 17-node tree)")
    o.add_argument("--context", type=_positive_int, default=200, help="cache length (200)")
    o.add_argument("--repeats", type=_positive_int, default=20)
    o.add_argument("--json", action="store_true")
    _add_decoding_args(o)

    ds = sub.add_parser("dist", help="per-depth TVD and top-k coverage of the drafter vs the target")
    ds.add_argument("--dataset", default="gsm8k", help="gsm8k, humaneval, mbpp (test splits), chat-dev (the ShareGPT "
                       "prompts held out from training, read from $TREEFLASH_DATA or ../shared/data) or a .jsonl file")
    ds.add_argument("--field", default=None)
    ds.add_argument("--limit", type=_positive_int, default=10)
    ds.add_argument("--max-new-tokens", type=_positive_int, default=128)
    ds.add_argument("--target", default=DEFAULT_TARGET)
    ds.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ds.add_argument("--device", default=None)
    ds.add_argument("--drafter", default=None, help="DFlash or TreeFlash drafter folder (default: the shipped "
                    "TreeFlash drafter, else the DFlash one)")
    ds.add_argument("--weaver", default=None, help="also measure this Weaver's conditionals (default: the shipped one, "
                    "with the shipped drafter)")
    ds.add_argument("--temperature", type=_non_negative_float, default=0.0,
                    help="continuations sampled at this temperature, coverage of its distribution (0: greedy)")
    ds.add_argument("--seed", type=int, default=0)
    ds.add_argument("--out", default=None, help="write the metrics as JSON")
    ds.add_argument("--plot", default=None, help="write the depth curves as a PNG")
    ds.add_argument("--no-progress", action="store_true")

    gb = sub.add_parser("gdn-bench", help="Gated DeltaNet tree verification: per-branch replay vs per-node "
                        "recurrence vs masked tree solve (error, speed, memory)")
    gb.add_argument("--tree-size", type=_int_list, default=[16, 32, 64, 128], help="nodes per tree (16,32,64,128)")
    gb.add_argument("--heads", type=_positive_int, default=32)
    gb.add_argument("--dk", type=_positive_int, default=128)
    gb.add_argument("--dv", type=_positive_int, default=128)
    gb.add_argument("--repeats", type=_positive_int, default=3, help="timed runs per implementation (median)")
    gb.add_argument("--seed", type=int, default=0)
    gb.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    gb.add_argument("--threads", type=_positive_int, default=None, help="torch CPU threads (default: torch's)")
    gb.add_argument("--json", action="store_true")

    data = sub.add_parser("data", help="training data").add_subparsers(dest="data_command", required=True,
                                                                      parser_class=Parser)
    rg = data.add_parser("regen", help="the target regenerates the answers of training prompts into an answer store "
                         "(appends; resumes from what the store holds)")
    rg.add_argument("--out", default=DEFAULT_STORE, help=f"the answer store ({DEFAULT_STORE}: the repository's)")
    rg.add_argument("--sources", default="gsm8k,mbpp,sharegpt,code_alpaca",
                    help="training prompt sets (gsm8k,mbpp,sharegpt,code_alpaca); never the test splits")
    rg.add_argument("--data-dir", default=None, help="where the prompt sets are (../shared/data, or TREEFLASH_DATA)")
    rg.add_argument("--limit", type=_positive_int, default=None, help="at most this many prompts in all")
    rg.add_argument("--batch-size", type=_positive_int, default=32)
    rg.add_argument("--max-new-tokens", type=_positive_int, default=256)
    rg.add_argument("--shard-size", type=_positive_int, default=512, help="answers per shard of the store (512)")
    rg.add_argument("--target", default=DEFAULT_TARGET)
    rg.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    rg.add_argument("--device", default=None)
    rg.add_argument("--seed", type=int, default=0, help="prompt order, and the samples at temperature > 0")
    rg.add_argument("--temperature", type=_non_negative_float, default=0.0,
                    help="0: greedy answers (default); > 0: the target's samples at this temperature")

    rk = data.add_parser("rank", help="rank tokens by frequency in regenerated answers, for a drafter's FR-Spec "
                         "draft vocabulary (writes token_ranking.json beside its config.json)")
    rk.add_argument("--data", default=DEFAULT_STORE, help=f"answer store(s), commas ({DEFAULT_STORE})")
    rk.add_argument("--drafter", required=True, help="drafter folder to write token_ranking.json into")
    rk.add_argument("--size", type=int, default=None,
                    help="also set draft_vocab_size = N in its config.json (0: the whole vocabulary)")

    mf = data.add_parser("manifest", help="what answer stores hold: answers per source and temperature, tokens, and "
                         "the commands and commits that made them (JSON)")
    mf.add_argument("data", nargs="?", default=DEFAULT_STORE, help=f"answer store(s), commas ({DEFAULT_STORE})")
    mf.add_argument("--out", default=None, help="also write the JSON here")
    ck = data.add_parser("check", help="check an answer store against its manifest: shards present, sha256 and "
                         "counts as recorded, no id answered twice, no stray files (exit 1 on a problem)")
    ck.add_argument("data", nargs="?", default=DEFAULT_STORE, help=f"the answer store ({DEFAULT_STORE})")
    im = data.add_parser("import", help="move a folder of JSONL shards (data regen before the answer store) into "
                         "an answer store")
    im.add_argument("folder", help="the old folder (shard-*.jsonl and runs.jsonl)")
    im.add_argument("--into", default=DEFAULT_STORE, help=f"the answer store ({DEFAULT_STORE})")

    ex = sub.add_parser("export", help="write a drafter in the published DFlash (and TreeFlash) format, with the "
                        "command lines that serve it in SGLang and vLLM")
    ex.add_argument("drafter", help="a DFlash or TreeFlash drafter folder (written by `treeflash train`)")
    ex.add_argument("--to", required=True, help="the folder to write")
    ex.add_argument("--target", default=DEFAULT_TARGET, help="the target it drafts for, named in the README's "
                    "command lines (default: the embedded one, as its Hub id)")

    tr = sub.add_parser("train", help="train drafters").add_subparsers(dest="train_command", required=True,
                                                                       parser_class=Parser)
    td = tr.add_parser("dflash", help="train a DFlash block drafter on regenerated data (torchrun for DDP)")
    tq = tr.add_parser("dflash2", help="train a DFlash2 drafter (convs + candidate selector), from scratch, from a "
                       "DFlash drafter, or its selector alone on a frozen backbone (torchrun for DDP)")
    for t in (td, tq):  # a fresh drafter's sizes
        t.add_argument("--layers", type=_positive_int, default=3, help="drafter decoder layers (3)")
        t.add_argument("--taps", type=_positive_int, default=5, help="target layers tapped for context (5)")
        t.add_argument("--intermediate-size", type=_positive_int, default=None, help="MLP width (the target's)")
        t.add_argument("--block-size", type=_positive_int, default=16)
        t.add_argument("--mask-token", default=None, metavar="ID|TOKEN",
                       help="the token that fills the drafted positions of a block: an id or the token's text (default: "
                       "the tokenizer's mask token, else a spare special token; SmolLM2: <empty_output>, 16)")
    td.add_argument("--init-layers", default="random", choices=["random", "target"],
                    help="a fresh drafter's layers: random (default), or copies of the target's last layers with the "
                    "deepest tap as context")
    td.add_argument("--init", default=None, help="a trained DFlash drafter folder to go on training, e.g. on new "
                    "data (its sizes are kept: --layers, --taps, --intermediate-size, --block-size do not apply)")
    tt = tr.add_parser("treeflash", help="train TreeFlash's AR layer on a DFlash backbone (torchrun for DDP)")
    tt.add_argument("--backbone", required=True,
                    help="DFlash drafter folder to start from (a TreeFlash drafter: train its AR layer further)")
    tt.add_argument("--freeze-backbone", action="store_true", help="train the AR layer only")
    tt.add_argument("--ar-kind", default="swiglu", choices=["swiglu", "linear"])
    tt.add_argument("--prev-tokens", type=int, default=1, choices=[1, 2], help="previous tokens conditioned on")
    tt.add_argument("--ar-intermediate-size", type=_positive_int, default=None, help="SwiGLU width (the MLP's)")
    tt.add_argument("--init", default=None, help="a TreeFlash drafter whose AR layer starts the training, e.g. one "
                    "of an older backbone (its --ar-* settings are kept)")
    tw = tr.add_parser("weaver", help="train a Weaver adapter on a frozen DFlash backbone (torchrun for DDP)")
    tw.add_argument("--backbone", required=True, help="DFlash drafter folder (frozen)")
    tw.add_argument("--width", type=_positive_int, default=None, help="Weaver width (the drafter's hidden size)")
    tw.add_argument("--weaver-layers", type=_positive_int, default=1, help="causal attention layers (1)")
    tw.add_argument("--heads", type=_positive_int, default=None, help="attention heads (the drafter's)")
    tw.add_argument("--top-k", type=_positive_int, default=512, help="candidates per depth, K (512)")
    tw.add_argument("--init", default=None, help="a trained Weaver folder to go on training (its sizes are kept)")
    tq.add_argument("--backbone", default=None, help="a DFlash drafter folder to start from: its weights, the convs "
                    "the identity, a fresh selector")
    tq.add_argument("--init", default=None, help="a DFlash2 drafter folder to go on training (its sizes are kept)")
    tq.add_argument("--selector-only", action="store_true", help="train the candidate selector alone, the backbone "
                    "frozen (needs --backbone or --init)")
    tq.add_argument("--selector-rank", type=_positive_int, default=32,
                    help="r of the selector's two [V, r] codebooks (32: 6 MB in bf16 for SmolLM2's vocabulary)")
    tq.add_argument("--selector-top-k", type=_positive_int, default=16, help="candidates per slot, K (16)")
    tq.add_argument("--conv-kernel-size", type=_positive_int, default=2, help="Kc, taps of the causal convs (2)")
    tq.add_argument("--conv-group-size", type=_positive_int, default=16, help="channels per dynamic kernel (16)")
    tq.add_argument("--selector-weight", type=float, default=1.0, help="weight of the selector's loss (1)")
    for t in (td, tt):
        t.add_argument("--kl-topk", type=int, default=0, help="sparse forward KL over the target's top-k (0: full)")
        t.add_argument("--draft-vocab", type=int, default=None, metavar="N",
                       help="train on the N tokens most frequent in the answers, the FR-Spec rows the drafter scores "
                       "at inference (0: the whole vocabulary; default: a trained drafter's own, else 4096)")
    for t, out in ((td, "runs/dflash"), (tq, "runs/dflash2"), (tt, "runs/treeflash"), (tw, "runs/weaver")):
        t.add_argument("--data", default=DEFAULT_STORE,
                       help=f"answer store written by `treeflash data regen` ({DEFAULT_STORE}), or several, commas")
        t.add_argument("--data-dir", default=None, help="where the prompt sets are, read back by id "
                       "(../shared/data, or TREEFLASH_DATA)")
        t.add_argument("--out", default=out, help=f"run folder: checkpoint.pt, log.jsonl, {'weaver' if t is tw else 'drafter'}/ ({out})")
        t.add_argument("--target", default=DEFAULT_TARGET)
        t.add_argument("--target-dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                       help="the target's weights (auto: bf16 where the hardware multiplies it natively, else fp32)")
        t.add_argument("--device", default=None)
        t.add_argument("--steps", type=_positive_int, default=1000)
        t.add_argument("--batch-size", type=_positive_int, default=4, help="sequences per step, all processes")
        t.add_argument("--lr", type=float, default=6e-4)
        t.add_argument("--num-anchors", type=_positive_int, default=512,
                       help="blocks per sequence, at most one per answer position (512: every position, mostly)")
        t.add_argument("--threads", type=_positive_int, default=None,
                       help="torch CPU threads (default: torch's; 1 leaves a core to another job)")
        t.add_argument("--max-len", type=_positive_int, default=512, help="tokens per sequence (512)")
        t.add_argument("--no-bf16", dest="bf16", action="store_false", default=None,
                       help="fp32 (default: bf16 autocast where the hardware multiplies bf16 natively, else fp32)")
        t.add_argument("--save-every", type=_positive_int, default=100)
        t.add_argument("--log-every", type=_positive_int, default=10)
        t.add_argument("--keep-every", type=int, default=0, help="keep drafter snapshots every N steps (0: no)")
        t.add_argument("--seed", type=int, default=0)
        t.add_argument("--no-resume", action="store_true", help="ignore an existing checkpoint in --out")
    return parser


def _int_list(text: str) -> list[int]:
    try:
        return [_positive_int(x) for x in text.split(",")]
    except (ValueError, argparse.ArgumentTypeError):
        raise argparse.ArgumentTypeError(f"expected positive integers separated by commas, got {text!r}") from None


def _sampling(args):
    from .verify import Sampling

    try:
        return Sampling(args.temperature, args.top_k, args.top_p)
    except ValueError as err:
        raise UsageError(str(err)) from None


def _load_target(args):
    from .target import Target

    return Target.load(args.target, dtype=args.dtype, device=args.device, runtime=getattr(args, "runtime", "auto"),
                       quantize=getattr(args, "quantize", "auto"), compile=getattr(args, "compile", "off"))


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
    from .drafters import make_drafter
    from .engine import generate

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

    drafter = make_drafter(args.method, target, args.drafter, args.weaver, args.tfm_width, args.draft_vocab)
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
    from .drafters import make_drafter
    from .serve.app import Settings, is_loopback, run

    sampling = _sampling(args)
    _choose_method(args)
    api_key = args.api_key or os.environ.get("TREEFLASH_API_KEY") or None
    if api_key is None and not is_loopback(args.host):
        print(f"treeflash: warning: serving on {args.host} without an API key: whoever reaches it can use it "
              "(set --api-key or TREEFLASH_API_KEY)", file=sys.stderr)
    target = _load_target(args)
    drafter = make_drafter(args.method, target, args.drafter, args.weaver, args.tfm_width, args.draft_vocab)
    settings = Settings(model=args.served_model_name or args.target, method=args.method, api_key=api_key,
                        timeout=args.timeout, max_tokens=args.max_new_tokens, temperature=sampling.temperature,
                        top_p=sampling.top_p, top_k=sampling.top_k, seed=args.seed)
    run(target, drafter, settings, args.budget, args.max_budget, args.max_queue, args.host, args.port,
        args.max_batch)


def _choose_method(args) -> None:
    """--method left out: the fastest method available for the target (see the model cards' benchmarks)."""
    if args.method is None:
        available = available_methods(args.target, args.drafter)
        args.method = next(m for m in ("treeflash", "ddtree", "dflash2-tree", "pld") if m in available)
    if args.method == "tfm":
        _require_weaver(args)


def _require_weaver(args) -> None:
    from .drafters.load import default_weaver_path

    if not (args.weaver or default_weaver_path(args.target, args.drafter)):
        raise UsageError("method tfm needs --weaver PATH (a folder written by `treeflash train weaver` on the "
                         "drafter in use)")


def available_methods(target: str, drafter: str | None, weaver: str | None = None) -> list[str]:
    """The methods that can run: ar, pld, and the block methods of the named drafter (else of the drafters shipped
    for the target): treeflash needs an AR layer, tfm a Weaver (named, or shipped with the shipped drafter)."""
    from pathlib import Path

    from .drafters.load import default_weaver_path, shipped_drafter
    from .models.dflash2 import is_dflash2

    methods = ["ar", "pld"]
    if drafter and is_dflash2(drafter):  # its own methods only: the DFlash ones cannot read its layers
        return methods + ["dflash2", "dflash2-tree"]
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
    from .eval.bench import format_table, run_bench
    from .eval.datasets import load_prompts

    sampling = _sampling(args)
    prompts = load_prompts(args.dataset, args.field, args.limit)
    if args.methods is None:
        args.methods = available_methods(args.target, args.drafter, args.weaver)
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
                        tfm_widths=args.tfm_width, max_budget=args.max_budget, draft_vocab_size=args.draft_vocab)
    dtype = str(target.dtype).removeprefix("torch.")
    report = {"target": args.target, "dataset": args.dataset, "num_prompts": len(prompts), "budgets": args.budget,
              "max_budget": args.max_budget, "tfm_widths": args.tfm_width, "draft_vocab": args.draft_vocab,
              "temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p,
              "max_new_tokens": args.max_new_tokens, "dtype": dtype, "runtime": target.runtime,
              "compiled": target.compiled,
              "weights": _weights(target), "threads": torch.get_num_threads(), "max_rss_mib": _max_rss_mib(),
              "seconds": time.time() - started, "methods": methods}
    print(f"{args.dataset}: {len(prompts)} prompts, budget {','.join(map(str, args.budget))} (max {args.max_budget}), "
          f"T = {args.temperature}, {args.max_new_tokens} new tokens, target {args.target} ({dtype}, "
          f"{target.runtime} runtime{', compiled' if target.compiled else ''}, {torch.get_num_threads()} threads; "
          f"weights: {target.weights})")
    print(format_table(methods))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)


def _batch_bench(args, target, prompts, sampling) -> None:
    from .eval.baselines import BASELINES
    from .eval.batch_bench import format_batch_table, run_batch_bench
    from .eval.bench import EAGER
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
                           draft_vocab_size=args.draft_vocab, repeats=args.repeats)
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
                  "repeats": args.repeats, "threads": torch.get_num_threads(), "seconds": time.time() - started, "variants": rows}
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)


def cmd_paired(args) -> None:
    from .eval.datasets import load_prompts
    from .eval.paired import format_paired, paired_drafters, run_paired

    prompts = load_prompts(args.dataset, args.field, args.limit)
    methods = [m for m in args.methods or available_methods(args.target, args.drafter, args.weaver) if m != "ar"]
    if not methods:
        raise UsageError("paired compares tree builders: name at least one method other than ar")
    if "tfm" in methods:
        _require_weaver(args)
    target = _load_target(args)
    drafters = paired_drafters(target, methods, args.budget, args.tfm_width, args.drafter, args.weaver,
                               args.draft_vocab)
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
    from .eval.overhead import measure_overhead

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
    from .drafters.load import default_drafter_path, default_weaver_path, shipped_drafter
    from .eval.datasets import load_prompts
    from .eval.dist import distribution_metrics, format_table, plot
    from .models.dflash import DFlashDrafter
    from .models.weaver import Weaver

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

    from .gdn.bench import format_table, run_bench

    if args.threads:
        torch.set_num_threads(args.threads)
    result = run_bench(tuple(args.tree_size), args.heads, args.dk, args.dv, args.repeats, args.seed, args.device)
    print(json.dumps(result) if args.json else format_table(result))


def cmd_data(args) -> None:
    import shlex
    from pathlib import Path

    from .eval.datasets import default_data_dir
    from .train.data import regenerate, source_commit, training_prompts
    from .train.store import AnswerStore, import_jsonl, stores

    if args.data_command == "rank":
        return cmd_rank(args)
    if args.data_command == "manifest":
        text = json.dumps([store.summary() for store in stores(args.data)], indent=2)
        if args.out:
            Path(args.out).write_text(text + "\n")
        return print(text)
    if args.data_command == "check":
        store = stores(args.data)[0]
        problems = store.verify()
        for problem in problems:
            print(f"{store.folder}/{problem}", file=sys.stderr)
        print(json.dumps({"store": str(store.folder), "shards": len(store.entries()), "problems": len(problems)}))
        return 1 if problems else None
    if args.data_command == "import":
        return print(json.dumps({"added": import_jsonl(args.folder, AnswerStore(args.into)), "store": args.into}))

    data_dir = Path(args.data_dir) if args.data_dir else default_data_dir()
    prompts = training_prompts(data_dir, [s.strip() for s in args.sources.split(",") if s.strip()])
    if args.limit:
        prompts = prompts[: args.limit] if len(args.sources.split(",")) == 1 else _spread(prompts, args.limit)
    meta = {"target": args.target, "dtype": args.dtype, "commit": source_commit(),
            "command": shlex.join(args.command_line)}
    report = regenerate(_load_target(args), prompts, AnswerStore(args.out), meta, args.max_new_tokens,
                        args.batch_size, seed=args.seed, temperature=args.temperature, shard_size=args.shard_size)
    print(json.dumps(report))


def cmd_rank(args) -> None:
    from pathlib import Path

    from .models.dflash_io import RANKING_FILE
    from .train.data import token_ranking
    from .train.store import stores

    folder = Path(args.drafter)
    if not (folder / "config.json").is_file():
        raise UsageError(f"no drafter at {folder} (config.json missing)")
    ranking, stats = token_ranking([a.response_ids for store in stores(args.data) for a in store.answers()])
    (folder / RANKING_FILE).write_text(json.dumps({"data": args.data, **stats, "ranking": ranking}) + "\n")
    if args.size is not None:
        config = json.loads((folder / "config.json").read_text())
        config["draft_vocab_size"] = args.size or None
        (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    print(json.dumps({"drafter": str(folder), **stats, "draft_vocab_size": args.size}))


def _spread(items: list, n: int) -> list:
    """n items drawn evenly across the list (a limit that keeps every source)."""
    step = len(items) / n
    return [items[int(i * step)] for i in range(min(n, len(items)))]


def cmd_export(args) -> None:
    from .models.export import export_drafter

    summary = export_drafter(args.drafter, args.to, args.target)
    print(json.dumps(summary, indent=2))


def cmd_train(args) -> None:
    from .target import default_device, native_bf16
    from .train import dflash, dflash2, weaver

    trainer = {"weaver": weaver, "dflash2": dflash2}.get(args.train_command, dflash)
    if args.bf16 is None:  # emulated bf16 (AVX2-only CPUs) makes a step several times slower than fp32
        args.bf16 = native_bf16(default_device(args.device))
    print(json.dumps(trainer.run(args)))


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        args = build_parser().parse_args(argv)
        args.command_line = ["treeflash", *(sys.argv[1:] if argv is None else argv)]  # what the manifests record
        _quiet_libraries()
        status = {"generate": cmd_generate, "serve": cmd_serve, "bench": cmd_bench, "paired": cmd_paired,
                  "overhead": cmd_overhead, "gdn-bench": cmd_gdn_bench, "dist": cmd_dist, "data": cmd_data,
                  "export": cmd_export, "train": cmd_train}[args.command](args)
    except KeyboardInterrupt:
        print("treeflash: interrupted", file=sys.stderr)
        return 130
    except Exception as err:  # user-caused errors: one line, no traceback
        from .eval.datasets import DatasetError
        from .models.checkpoint import DrafterError
        from .target import TargetError

        if not isinstance(err, (UsageError, DatasetError, DrafterError, TargetError, OSError)):
            raise
        print(f"treeflash: error: {err}", file=sys.stderr)
        return 2
    return status or 0  # a command returns 1 when what it checked failed


def _quiet_libraries() -> None:
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    logging.basicConfig(level=logging.WARNING, format="treeflash: %(message)s")


if __name__ == "__main__":
    sys.exit(main())
