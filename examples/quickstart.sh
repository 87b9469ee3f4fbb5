#!/usr/bin/env bash
# Install kvforge with its compiler, build the bundled example model into a verified artifact,
# and stream text from it.
#
# examples/model is a small Llama trained on the Python standard library's source
# (examples/README.md says how); nothing is trained or downloaded here. The build prints
# its stage times and the verification gate's verdict (eager vs compiled, on this machine).
# It installs only what these steps use, into .venv; `bash .ci/install` adds what the tests need.
set -euo pipefail
cd "$(dirname "$0")/.."
step() { echo "quickstart: $*"; }
elapsed() { echo "quickstart: done in $((SECONDS - $1)) s"; }

start=$SECONDS
[[ -x .venv/bin/python ]] || python3 -m venv .venv
# The CPU build of torch first (where the machine keeps its wheel, nothing is downloaded); the
# [build] extra's torch>=2.13 is then satisfied and pip fetches no CUDA build.
# --no-compile: compiling every file of torch and transformers at install time costs time for
# modules the build never imports. Bytecode is written instead as each module first loads, by the
# commands below (PYTHONDONTWRITEBYTECODE is emptied for them: many container images set it, and
# then every later command would compile torch's and transformers' modules again, seconds each time).
export PYTHONDONTWRITEBYTECODE=
step "installing torch 2.13.0 (CPU build) into .venv"
.venv/bin/python -m pip install -q --disable-pip-version-check --no-compile "torch==2.13.0"
step "installing kvforge[build]: transformers, onnx, onnx-ir, onnxscript, onnxruntime, tokenizers..."
# transformers at the release the suite last passed on (see .ci/install)
.venv/bin/python -m pip install -q --disable-pip-version-check --no-compile -e ".[build]" "transformers==5.25.0"
.venv/bin/python -m compileall -q kvforge toolchain passes runners  # kvforge's own modules, installed editable
elapsed "$start"

start=$SECONDS
step "building examples/model into example-out"
.venv/bin/kvforge build examples/model -o example-out --force
elapsed "$start"

step "generating from example-out (onnxruntime only: no torch at run time)"
.venv/bin/kvforge generate example-out "def read_config(path):" --max-new-tokens 96 --temperature 0.7 --top-p 0.9 --seed 1
