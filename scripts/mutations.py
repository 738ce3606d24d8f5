"""Deliberate breakages, one per property that issue 33 asks the tests to guard: apply one to the code, run the tests
that guard it, record whether they failed (they must), restore the file. From the repository root:

    .venv/bin/python scripts/mutations.py [ID ...]    # all, or the named ones; results: docs/results/mutations.json

The exact-sequence test carries its own broken copies (biased acceptance, a wrong top-p, the drafter's distribution
as the target's, no residual): tests/test_exact_sequences.py::test_a_broken_copy_fails_the_same_test.
"""

import json
import subprocess
import sys
import time
from pathlib import Path

OUT = Path("docs/results/mutations.json")
# id: (what it guards, file, the line as it is, the line broken, the tests that must fail)
MUTATIONS = {
    "rope-sign": ("1 outside reference: a bug the engine and `ar` share", "src/treeflash/runtime/static_decoder.py",
                  "rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)",
                  "rotated = torch.cat([x[..., half:], -x[..., :half]], dim=-1)",
                  ["tests/test_outside_reference.py", "-k", "ar and not batched"]),
    "batched-positions": ("1 outside reference: batched methods", "src/treeflash/batching.py",
                          "positions[b, :len(tree)] = tree.positions(self.lengths[b])",
                          "positions[b, :len(tree)] = tree.positions(self.lengths[b] + (b > 0))",
                          ["tests/test_outside_reference.py", "-k", "batched"]),
    "top-k-ties": ("1 Sampling against transformers' processors", "src/treeflash/verify.py",
                   'logits = logits.masked_fill(logits < kth, float("-inf"))',
                   'logits = logits.masked_fill(logits <= kth, float("-inf"))',
                   ["tests/test_sampling.py", "-k", "transformers_processors"]),
    "bf16-scale": ("3 bf16 within a named tolerance of fp32", "src/treeflash/runtime/static.py",
                   "return TargetOutput(logits.float(), hidden)",
                   "return TargetOutput(logits.float() * (1.05 if logits.dtype == torch.bfloat16 else 1), hidden)",
                   ["tests/test_target.py", "-k", "bf16"]),
    "choose-full": ("4 Policy.choose against brute force", "src/treeflash/speculation.py",
                    "n = max(range(size + 1), key=net.__getitem__)", "n = size",
                    ["tests/test_speculation.py", "-k", "brute_force"]),
    "probe-credit": ("4 probes cost at most their allowance", "src/treeflash/speculation.py",
                     "return self.skipped >= self.PROBE_GAP and self.credit >= max(self.probe_loss or 0.0, 0.0)",
                     "return self.skipped >= self.PROBE_GAP",
                     ["tests/test_speculation.py", "-k", "allowance or paying_stretch"]),
    "no-catch-up": ("4 trees verified after the drafter's catch-up", "src/treeflash/engine.py",
                    "tree = self.drafter.propose(seq.tokens, seq.features, budget)",
                    "tree = self.drafter.propose(seq.tokens, None, budget)",
                    ["tests/test_speculation.py", "-k", "catches_up"]),
    "ddp-no-average": ("5 two DDP processes train the weights of one", "src/treeflash/train/trainer.py",
                       "(loss / per_rank).backward()", "(loss / per_rank * (1 + rank)).backward()",
                       ["tests/test_train_exact.py", "-k", "two_ddp"]),
    "resume-no-optim": ("5 a run killed mid-step resumes to the same weights", "src/treeflash/train/trainer.py",
                        'optim.load_state_dict(state["optim"])', "pass",
                        ["tests/test_train_exact.py", "-k", "killed_mid_step and not ddp"]),
    "bad-safetensors": ("6 a broken file is one line, no traceback", "src/treeflash/models/checkpoint.py",
                        "except Exception as err:  # safetensors' own error type: truncated, corrupted, not "
                        "safetensors at all", "except KeyError as err:",
                        ["tests/test_bad_files.py", "-k", "broken_drafter and break_weights"]),
    "empty-prompt": ("7 no 5xx under fuzzing", "src/treeflash/serve/app.py",
                     "if not prompt:  # text the tokenizer drops entirely (control characters)", "if False:",
                     ["tests/test_serve.py", "-k", "fuzzed or bad_requests"]),
    "retry-after-constant": ("7 Retry-After from the queue", "src/treeflash/serve/worker.py",
                             "return max(MIN_RETRY_AFTER_S, math.ceil(self.depth * mean / self.slots))",
                             "return MIN_RETRY_AFTER_S", ["tests/test_serve.py", "-k", "retry_after"]),
    "default-temperature": ("7 OpenAI's default temperature", "src/treeflash/serve/__init__.py",
                            "DEFAULT_TEMPERATURE = 1.0", "DEFAULT_TEMPERATURE = 0.0",
                            ["tests/test_serve.py", "-k", "without_temperature"]),
}


def main(only: list[str]) -> int:
    results = json.loads(OUT.read_text()) if OUT.exists() else {}
    for name, (guards, path, line, broken, tests) in MUTATIONS.items():
        if only and name not in only:
            continue
        file = Path(path)
        source = file.read_text()
        if source.count(line) != 1:
            raise SystemExit(f"{name}: the line to break is not once in {path}")
        file.write_text(source.replace(line, broken))
        started = time.time()
        try:
            run = subprocess.run([sys.executable, "-m", "pytest", "-o", "addopts=", "-q", "-x", "-p",
                                  "no:cacheprovider", *tests], capture_output=True, text=True, timeout=900)
        finally:
            file.write_text(source)
        lines = run.stdout.strip().splitlines()
        caught = run.returncode == 1  # tests failed (2-5: an error of pytest itself)
        results[name] = {"guards": guards, "file": path, "breakage": f"{line} -> {broken}", "tests": " ".join(tests),
                         "caught": caught, "summary": lines[-1] if lines else run.stderr[-300:],
                         "seconds": round(time.time() - started)}
        print(f"{name}: {'caught' if caught else 'NOT CAUGHT'} ({results[name]['summary']})", flush=True)
        OUT.write_text(json.dumps(results, indent=1) + "\n")
    return 0 if all(r["caught"] for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
