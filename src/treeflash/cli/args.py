"""The command line's parser: every command's arguments and the types that check them."""

from __future__ import annotations

import argparse

from .. import __version__


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


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
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
    from ..drafters import METHODS
    from ..eval.baselines import BASELINES
    from ..eval.bench import EAGER

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


def _non_negative_floats(text: str) -> list[float]:
    return [_non_negative_float(x) for x in text.split(",")]


def _paths(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def _int_list(text: str) -> list[int]:
    try:
        return [_positive_int(x) for x in text.split(",")]
    except (ValueError, argparse.ArgumentTypeError):
        raise argparse.ArgumentTypeError(f"expected positive integers separated by commas, got {text!r}") from None


def _add_decoding_args(p: argparse.ArgumentParser, sweep: bool = False, weavers: bool = False,
                       paired: bool = False, serve: bool = False) -> None:
    """Decoding options; with `sweep` (bench, paired), --budget and --tfm-width take comma-separated lists, with
    `weavers` (paired) --weaver too; `serve` has --default-temperature for --temperature (requests name their own)."""
    from ..engine import DEFAULT_MAX_BUDGET, GPU_MAX_BUDGET
    from ..runtime import DEFAULT_TARGET

    ints, several = (_positive_ints, "; a list such as 16,64 runs each") if sweep else (_positive_int, "")
    if paired:
        p.add_argument("--budget", type=_positive_ints, default=[16],
                       help="draft nodes per tree, root excluded (16; a list such as 16,64 runs each)")
    else:
        p.add_argument("--budget", type=_budgets if sweep else _budget, default=["auto"] if sweep else "auto",
                       help="draft nodes per tree, root excluded, or auto (default): each round the tree prefix "
                       "that maximises expected tokens per second, or a plain AR step when none pays"
                       + ("; a list such as auto,16,64 runs each" if sweep else ""))
        p.add_argument("--max-budget", type=_positive_int, default=None,
                       help=f"the largest tree auto drafts ({DEFAULT_MAX_BUDGET} on a CPU, {GPU_MAX_BUDGET} on CUDA)")
    if serve:
        from ..serve import DEFAULT_TEMPERATURE

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
                   help="compile the target's decoding layer ahead of time (torch.export, AOTInductor): auto does "
                   "where that is fast (a 4-bit GGUF target on the CPU, with a C++ compiler; about 33 s at the first "
                   "start on 2 cores, cached after), on always (on CUDA: the verification forwards as CUDA graphs, "
                   "not yet run on a GPU in the engine), off never (eager: the reference); "
                   f"default {compile_default}")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--drafter", default=None, help="DFlash drafter folder for dflash/ddtree/tfm "
                   "(default: the one shipped for the target), a DFlash2 folder for dflash2 / dflash2-tree, or an "
                   "EAGLE-3 folder for eagle3 (none ships)")
    p.add_argument("--datastore", default=None, metavar="FOLDER",
                   help="datastore for rest: the target's own answers, indexed (written by `treeflash data datastore`; "
                   "default: the one shipped for the target)")
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
    from dataclasses import fields

    from ..drafters import METHODS
    from ..runtime import DEFAULT_TARGET
    from ..train.config import RUNS
    from ..train.store import DEFAULT_STORE

    parser = Parser(prog="treeflash", description="Lossless tree speculative decoding with one-shot block drafters.")
    parser.add_argument("--version", action="version", version=f"treeflash {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)

    g = sub.add_parser("generate", help="generate text for one prompt, streamed")
    g.add_argument("prompt")
    g.add_argument("--method", default=None, choices=list(METHODS),
                   help="decoding method (default: pld on a CPU; on a GPU treeflash with the shipped drafter, else "
                   "ddtree, else pld)")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    _add_decoding_args(g)

    sv = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (/v1/chat/completions, /v1/completions)",
                        description="Requests that leave out max_tokens, temperature, top_p or seed get "
                        "--max-new-tokens, --default-temperature (1, as with OpenAI; 0: greedy), --top-p, and a seed "
                        "drawn from --seed.")
    sv.add_argument("--method", default=None, choices=list(METHODS),
                    help="decoding method (default: pld on a CPU; on a GPU treeflash with the shipped drafter, else "
                    "ddtree, else pld)")
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
        b.add_argument("--dataset", default="gsm8k", help="gsm8k, humaneval, mbpp (test splits), chat-dev (the "
                       "ShareGPT prompts held out from training, read from $TREEFLASH_DATA or ../shared/data) or a "
                       ".jsonl file")
        b.add_argument("--field", default=None, help="prompt field of a .jsonl file "
                       "(default: the first of prompt, question, problem, text, turns)")
        b.add_argument("--limit", type=_positive_int, default=10, help="number of prompts (10)")
        b.add_argument("--methods", type=(lambda t: _methods(t, baselines=True)) if name == "bench" else _methods,
                       default=None, help=f"comma-separated ({','.join(METHODS)}"
                       + (", and the baselines hf, hf-pld, llamacpp, llamacpp-pld" if name == "bench" else "")
                       + "; default: those with a drafter shipped for the target)"
                       + ("; every variant is scored on the rounds the first one drives: one method per run gives "
                          "each its own tau" if name == "paired" else ""))
        b.add_argument("--out", default=None, help="write the results as JSON to this file")
        b.add_argument("--no-progress", action="store_true")
        if name == "bench":
            b.add_argument("--batch-size", type=_positive_ints, default=None, metavar="N[,M...]",
                           help="decode the prompts N at a time (continuous batching) and report total tokens/s "
                           "against batched ar and against batch size 1; a list such as 1,2,4,8 runs each")
            b.add_argument("--repeats", type=_positive_int, default=1,
                           help="runs of the whole set per variant, interleaved, each prompt's runs pooled in the "
                           "speedup's interval; at T > 0 each run draws new samples (1)")
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
                         "(appends; resumes from what the store holds; under torchrun each process answers its share)")
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

    mg = data.add_parser("magpie", help="the target writes user requests itself (Magpie: its chat template up to a "
                         "user turn, sampled) and answers them greedily, into an answer store with their ids "
                         "(appends; resumes): chat prompts beyond the prompt sets")
    mg.add_argument("--count", type=_positive_int, required=True,
                    help="requests to try, ids magpie/SEED-0 .. COUNT-1 (cut-off, empty and repeated ones are dropped)")
    mg.add_argument("--out", default=DEFAULT_STORE, help=f"the answer store ({DEFAULT_STORE}: the repository's)")
    mg.add_argument("--batch-size", type=_positive_int, default=32)
    mg.add_argument("--turn-tokens", type=_positive_int, default=128,
                    help="the longest request kept: one not ended within this many tokens is dropped (128)")
    mg.add_argument("--max-new-tokens", type=_positive_int, default=256, help="answer length (256)")
    mg.add_argument("--temperature", type=_positive_float, default=1.0,
                    help="the requests' sampling temperature (1); the answers are greedy")
    mg.add_argument("--shard-size", type=_positive_int, default=512, help="requests tried per shard (512)")
    mg.add_argument("--seed", type=int, default=0, help="the requests' samples; part of their ids")
    mg.add_argument("--target", default=DEFAULT_TARGET)
    mg.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    mg.add_argument("--device", default=None)

    rk = data.add_parser("rank", help="rank tokens by frequency in regenerated answers, for a drafter's FR-Spec "
                         "draft vocabulary (writes token_ranking.json beside its config.json)")
    rk.add_argument("--data", default=DEFAULT_STORE, help=f"answer store(s), commas ({DEFAULT_STORE})")
    rk.add_argument("--drafter", required=True, help="drafter folder to write token_ranking.json into")
    rk.add_argument("--size", type=int, default=None,
                    help="also set draft_vocab_size = N in its config.json (0: the whole vocabulary)")

    dst = data.add_parser("datastore", help="index the target's answers for retrieval drafting (method rest): writes "
                          "datastore.npz and datastore.json into a folder that --datastore names")
    dst.add_argument("--data", default=DEFAULT_STORE, help=f"answer store(s), commas ({DEFAULT_STORE})")
    dst.add_argument("--out", required=True, help="the datastore folder to write")
    dst.add_argument("--target", default=DEFAULT_TARGET, help="the target the answers are from (its vocabulary)")
    dst.add_argument("--temperature", type=_non_negative_float, default=0.0,
                     help="index the answers made at this temperature (0: the greedy ones, default)")

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
    ex.add_argument("drafter", help="a DFlash, TreeFlash, DFlash2 or EAGLE-3 drafter folder (written by "
                    "`treeflash train`)")
    ex.add_argument("--to", required=True, help="the folder to write")
    ex.add_argument("--target", default=DEFAULT_TARGET, help="the target it drafts for, named in the README's "
                    "command lines (default: the embedded one, as its Hub id)")

    tr = sub.add_parser("train", help="train drafters").add_subparsers(dest="train_command", required=True,
                                                                       parser_class=Parser)
    td = tr.add_parser("dflash", help="train a DFlash block drafter on regenerated data (torchrun for DDP)")
    tq = tr.add_parser("dflash2", help="train a DFlash2 drafter (convs + candidate selector), from scratch, from a "
                       "DFlash drafter, or its selector alone on a frozen backbone (torchrun for DDP)")
    for t in (td, tq):  # a fresh drafter's sizes
        t.add_argument("--layers", type=_positive_int, help="drafter decoder layers (3)")
        t.add_argument("--taps", type=_positive_int, help="target layers tapped for context (5)")
        t.add_argument("--intermediate-size", type=_positive_int, help="MLP width (the target's)")
        t.add_argument("--block-size", type=_positive_int)
        t.add_argument("--mask-token", metavar="ID|TOKEN",
                       help="the token that fills the drafted positions of a block: an id or the token's text "
                       "(default: the tokenizer's mask token, else a spare special token; SmolLM2: <empty_output>, 16)")
    td.add_argument("--init-layers", choices=["random", "target"],
                    help="a fresh drafter's layers: random (default), or copies of the target's last layers with the "
                    "deepest tap as context")
    td.add_argument("--init", help="a trained DFlash drafter folder to go on training, e.g. on new "
                    "data (its sizes are kept: --layers, --taps, --intermediate-size, --block-size do not apply)")
    td.add_argument("--add-layers", type=_non_negative_int, default=0, metavar="N",
                    help="with --init: grow the drafter by N draft layers on top, each a copy of its last layer with "
                    "the output projections zeroed, so that it starts drafting exactly what the init does (0)")
    tt = tr.add_parser("treeflash", help="train TreeFlash's AR layer on a DFlash backbone (torchrun for DDP)")
    tt.add_argument("--backbone", required=True,
                    help="DFlash drafter folder to start from (a TreeFlash drafter: train its AR layer further)")
    tt.add_argument("--freeze-backbone", action="store_true", help="train the AR layer only")
    tt.add_argument("--ar-kind", choices=["swiglu", "linear"])
    tt.add_argument("--prev-tokens", type=int, choices=[1, 2], help="previous tokens conditioned on")
    tt.add_argument("--ar-intermediate-size", type=_positive_int, help="SwiGLU width (the MLP's)")
    tt.add_argument("--init", help="a TreeFlash drafter whose AR layer starts the training, e.g. one "
                    "of an older backbone (its --ar-* settings are kept)")
    tw = tr.add_parser("weaver", help="train a Weaver adapter on a frozen DFlash backbone (torchrun for DDP)")
    tw.add_argument("--backbone", required=True, help="DFlash drafter folder (frozen)")
    tw.add_argument("--width", type=_positive_int, help="Weaver width (the drafter's hidden size)")
    tw.add_argument("--weaver-layers", type=_positive_int, help="causal attention layers (1)")
    tw.add_argument("--heads", type=_positive_int, help="attention heads (the drafter's)")
    tw.add_argument("--top-k", type=_positive_int, help="candidates per depth, K (512)")
    tw.add_argument("--init", help="a trained Weaver folder to go on training (its sizes are kept)")
    tq.add_argument("--backbone", help="a DFlash drafter folder to start from: its weights, the convs "
                    "the identity, a fresh selector")
    tq.add_argument("--init", help="a DFlash2 drafter folder to go on training (its sizes are kept)")
    tq.add_argument("--selector-only", action="store_true", help="train the candidate selector alone, the backbone "
                    "frozen (needs --backbone or --init)")
    tq.add_argument("--selector-rank", type=_positive_int,
                    help="r of the selector's two [V, r] codebooks (32: 6 MB in bf16 for SmolLM2's vocabulary)")
    tq.add_argument("--selector-top-k", type=_positive_int, help="candidates per slot, K (16)")
    tq.add_argument("--conv-kernel-size", type=_positive_int, help="Kc, taps of the causal convs (2)")
    tq.add_argument("--conv-group-size", type=_positive_int, help="channels per dynamic kernel (16)")
    tq.add_argument("--selector-weight", type=float, help="weight of the selector's loss (1)")
    te = tr.add_parser("eagle3", help="train an EAGLE-3 drafter (one layer, training-time test) on regenerated "
                       "data (torchrun for DDP)")
    te.add_argument("--init", help="a trained EAGLE-3 drafter folder to go on training (its sizes are kept)")
    te.add_argument("--ttt-steps", type=_positive_int, help="training-time-test steps, each weighted 0.8^j (7)")
    ta = tr.add_parser("average", help="average drafter checkpoints of one model (e.g. consecutive training stages) "
                       "into one: the element-wise mean of their weights")
    ta.add_argument("folders", nargs="+", metavar="FOLDER", help="two drafter folders or more, the same model")
    ta.add_argument("--out", required=True, help="the folder to write")
    ta.add_argument("--weights", type=_non_negative_floats, metavar="W1,W2,...",
                    help="one weight per folder, normalised to sum 1 (default: equal), e.g. 1,2 towards the second")
    for t in (td, tq, tt):
        t.add_argument("--grad-checkpoint", action="store_true", help="recompute the drafter's layers in the "
                       "backward pass instead of keeping their activations (less memory, one more forward)")
    for t in (td, tt):
        t.add_argument("--kl-topk", type=int, help="sparse forward KL over the target's top-k (0: full)")
        t.add_argument("--loss-decay", type=_positive_float, metavar="D",
                       help="drafted position k of a block weighs exp(-(k - 1) / D) in the loss: a smaller D puts "
                       "more of it on the first positions, the ones small trees verify (7, DFlash's for γ = 16)")
    for t in (td, tt, tw):
        t.add_argument("--short-blocks", type=float, metavar="SHARE",
                       help="cut this share of the blocks to a random length (2..γ-1), so that the drafter drafts "
                       "from a block of B + 1 positions for a tree B deep, the cheap round of a CPU (default: 0.5 for "
                       "a drafter trained so, else 0)")
    for t in (td, tt, te):
        t.add_argument("--draft-vocab", type=int, metavar="N",
                       help="train on the N tokens most frequent in the answers, the FR-Spec rows the drafter scores "
                       "at inference (0: the whole vocabulary; default: a trained drafter's own, else 4096)")
    for t, out in ((td, "runs/dflash"), (tq, "runs/dflash2"), (tt, "runs/treeflash"), (tw, "runs/weaver"),
                   (te, "runs/eagle3")):
        t.add_argument("--data",
                       help=f"answer store written by `treeflash data regen` ({DEFAULT_STORE}), or several, commas")
        t.add_argument("--sources", help="train on these sources' answers only, commas; NAME:N keeps the first N "
                       "of one (e.g. sharegpt,gsm8k:300; default: all)")
        t.add_argument("--repeat", metavar="SOURCE[@T]=N", help="take these answers N times an epoch, commas: "
                       "sharegpt=3 all of a source's, sharegpt@0=3 its greedy ones only (default: each once)")
        t.add_argument("--data-dir", help="where the prompt sets are, read back by id "
                       "(../shared/data, or TREEFLASH_DATA)")
        folder = "weaver" if t is tw else "drafter"
        t.add_argument("--out", default=out, help=f"run folder: checkpoint.pt, log.jsonl, {folder}/ ({out})")
        t.add_argument("--target")
        t.add_argument("--target-dtype", choices=["auto", "float32", "bfloat16"],
                       help="the target's weights (auto: bf16 where the hardware multiplies it natively, else fp32)")
        t.add_argument("--device")
        t.add_argument("--steps", type=_positive_int)
        t.add_argument("--batch-size", type=_positive_int,
                       help="sequences per step, over all processes (default 4, rounded up to a multiple of them)")
        t.add_argument("--lr", type=float)
        t.add_argument("--num-anchors", type=_positive_int,
                       help="blocks per sequence, at most one per answer position (512: every position, mostly)")
        t.add_argument("--threads", type=_positive_int,
                       help="torch CPU threads (default: torch's; 1 leaves a core to another job)")
        t.add_argument("--max-len", type=_positive_int, help="tokens per sequence (512)")
        t.add_argument("--no-bf16", dest="bf16", action="store_false", default=None,
                       help="fp32 (default: bf16 autocast where the hardware multiplies bf16 natively, else fp32)")
        t.add_argument("--save-every", type=_positive_int)
        t.add_argument("--log-every", type=_positive_int)
        t.add_argument("--keep-every", type=int, help="keep drafter snapshots every N steps (0: no)")
        t.add_argument("--seed", type=int)
        t.add_argument("--no-resume", action="store_true", help="ignore an existing checkpoint in --out")
    for t in (td, tq, tt, tw, te):  # the defaults are the typed configs' (train/config.py)
        t.set_defaults(**{f.name: f.default for f in fields(RUNS[t.prog.split()[-1]]) if f.name != "out"})
    return parser
