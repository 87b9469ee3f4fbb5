"""Sizes as people write them: one reading of `2G`, `2GB` and `2GiB` for every flag and file.

IEC units are powers of 1024 (KiB, MiB, GiB, TiB), SI units powers of 1000 (kB, MB, GB, TB),
each meaning what it says; a bare K, M, G or T is a power of 1024, as for memory sizes in most
tools (`free -h`, llama.cpp, docker). Letters are read case-insensitively (`gib`, `Gb` and `GB`
are the same); a number with a unit may have a fraction (`1.5GiB`), a byte count may not.
"""

from __future__ import annotations

import re

from kvforge.runners.errors import KvforgeError

_POWERS = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4}
_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*(?:([kmgt])(i?)(b?)|(b?))")
SIZE_HELP = "KiB, MiB, GiB, TiB: powers of 1024; kB, MB, GB, TB: powers of 1000; K, M, G, T: powers of 1024"


def parse_bytes(text: str, what: str = "size") -> int:
    """Bytes of a size such as ``0``, ``268435456``, ``256MiB``, ``16GB``, ``2G`` or ``1.5GiB``.

    Raises KvforgeError naming `what` (a flag, a config field) and the units it takes."""
    match = _SIZE.fullmatch(text.strip().lower())
    if match is None or (match.group(3) and not match.group(4)) or ("." in match.group(1) and not match.group(2)):
        raise KvforgeError(
            f"{what} {text!r}: write a byte count or a number with a unit, such as 268435456, 256MiB, 16GB or "
            f"2G ({SIZE_HELP})"
        )
    number, letter, binary, suffix = match.group(1), match.group(2) or "", match.group(3), match.group(4)
    base = 1000 if letter and suffix and not binary else 1024
    if "." not in number:
        return int(number) * base ** _POWERS[letter]
    whole, fraction = number.split(".")
    scale = base ** _POWERS[letter]
    return int(whole) * scale + int(fraction) * scale // 10 ** len(fraction)
