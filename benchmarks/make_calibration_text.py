"""Write `toolchain/data/calibration.txt`, the text `kvforge build --weights int4` calibrates on.

    python benchmarks/make_calibration_text.py [OUT]

Mixed prose and code, all from CPython's standard library (PSF licence; see
`toolchain/data/calibration.LICENSE.txt`): the language reference's and library reference's
topics that `pydoc` ships (`pydoc_data.topics`, prose with examples), then whole standard-library
modules (code with docstrings and comments). None of the modules the held-out perplexity of
docs/performance.md reads (calendar, fractions, graphlib, netrc, queue, sched, shlex, textwrap,
and CPython's LICENSE) is taken. Deterministic for one Python release: the shipped file was
written by CPython 3.11.
"""

from __future__ import annotations

import sys
import sysconfig
from pathlib import Path

PROSE_BYTES = 200_000
CODE_BYTES = 180_000
# Modules of general-purpose code; none of the held-out ones
MODULES = (
    "bisect", "heapq", "contextlib", "functools", "dataclasses", "string", "difflib", "argparse",
    "copy", "enum", "csv", "pprint", "tokenize", "json/decoder", "json/encoder", "statistics",
)  # fmt: skip
HELD_OUT = {"calendar", "fractions", "graphlib", "netrc", "queue", "sched", "shlex", "textwrap"}


def prose(limit: int) -> str:
    from pydoc_data.topics import topics

    parts, size = [], 0
    for key in sorted(topics):
        text = topics[key].strip() + "\n\n"
        if size + len(text) > limit:
            continue
        parts.append(text)
        size += len(text)
    return "".join(parts)


def code(limit: int) -> str:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    parts, size = [], 0
    for name in MODULES:
        assert name.split("/")[0] not in HELD_OUT
        text = (stdlib / f"{name}.py").read_text(encoding="utf-8")
        text = text[: max(0, limit - size)]
        parts.append(text + "\n\n")
        size += len(text)
        if size >= limit:
            break
    return "".join(parts)


def main() -> None:
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parent.parent / "toolchain/data/calibration.txt"
    text = prose(PROSE_BYTES) + code(CODE_BYTES)
    out.write_text(text, encoding="utf-8", newline="\n")
    print(f"{out}: {len(text.encode())} bytes")


if __name__ == "__main__":
    main()
