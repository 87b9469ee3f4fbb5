#!/usr/bin/env bash
# Set up, build the bundled example model into a verified artifact, and stream text from it.
#
# examples/model is a small Llama trained on the Python standard library's source
# (examples/README.md says how); nothing is trained or downloaded here. The build prints
# its stage times and the verification gate's verdict (eager vs compiled, on this machine).
set -euo pipefail
cd "$(dirname "$0")/.."
bash .ci/install
.venv/bin/kvforge build examples/model -o example-out --force
.venv/bin/kvforge generate example-out "def read_config(path):" --max-new-tokens 96 --temperature 0.7 --top-p 0.9 --seed 1
