#!/usr/bin/env bash
# Set up, make the example checkpoint, build a verified artifact from it, stream text from it.
set -euo pipefail
cd "$(dirname "$0")/.."
bash .ci/install
.venv/bin/python examples/make_checkpoint.py example-checkpoint
.venv/bin/kvforge build example-checkpoint -o example-out --force
.venv/bin/kvforge generate example-out "def fibonacci(n):" --max-new-tokens 64 --temperature 0.7 --top-p 0.9 --seed 1
