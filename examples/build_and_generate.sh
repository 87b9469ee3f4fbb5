#!/usr/bin/env bash
# Build a verified artifact from a checkpoint and generate from it, from the shell.
#
#   bash examples/build_and_generate.sh CHECKPOINT OUT [PROMPT]
#
# Uses the repository's .venv when it exists (`bash .ci/install` makes it), else `kvforge`
# on PATH. Exits non-zero, with a one-line reason on stderr, if any step fails: the build
# publishes nothing unless the compiled graph matches the eager model.
set -euo pipefail
if [[ $# -lt 2 || $# -gt 3 ]]; then
    echo "usage: $0 CHECKPOINT OUT [PROMPT]" >&2
    exit 2
fi
checkpoint=$1
out=$2
prompt=${3:-"def main():"}
root="$(cd "$(dirname "$0")/.." && pwd)"
kvforge="$root/.venv/bin/kvforge"
[[ -x $kvforge ]] || kvforge=kvforge

# --force replaces a previous artifact at OUT (never a directory kvforge did not write).
"$kvforge" build "$checkpoint" -o "$out" --force
# Greedy, so the same artifact prints the same text every time.
"$kvforge" generate "$out" "$prompt" --max-new-tokens 48 --temperature 0
