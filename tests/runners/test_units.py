from __future__ import annotations

import pytest

from kvforge.runners.errors import KvforgeError
from kvforge.runners.units import parse_bytes


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("0", 0),
        ("1048576", 1 << 20),
        ("10B", 10),
        ("64k", 64 << 10),
        ("512M", 512 << 20),
        ("2G", 2 << 30),
        ("1T", 1 << 40),
        ("4KiB", 4 << 10),
        ("256MiB", 256 << 20),
        ("2GiB", 2 << 30),
        ("2 gib", 2 << 30),
        ("1.5GiB", 3 << 29),
        ("2kB", 2_000),
        ("2MB", 2_000_000),
        ("2GB", 2_000_000_000),
        ("16 GB", 16_000_000_000),
        ("0.5TB", 500_000_000_000),
        (" 3gb ", 3_000_000_000),
    ],
)
def test_iec_units_are_powers_of_1024_si_units_of_1000_and_bare_letters_of_1024(text: str, size: int) -> None:
    assert parse_bytes(text) == size


@pytest.mark.parametrize("bad", ["", "-1", "1.5", "lots", "12X", "G", "2Gi", "1e9", "1.5.5G", "2 parsecs"])
def test_refusals_name_the_setting_and_the_units(bad: str) -> None:
    with pytest.raises(KvforgeError, match=r"--prefix-cache-bytes '.*': write a byte count .*powers of 1000"):
        parse_bytes(bad, "--prefix-cache-bytes")


def test_the_build_and_the_server_read_a_size_alike() -> None:
    """--device-memory (a build) and --prefix-cache-bytes (the server, Triton) share one reading."""
    from kvforge.runners.triton.backend import EngineSettings
    from kvforge.toolchain.cli import _device_memory

    for text in ("2GB", "2G", "2GiB"):
        parameters = {"parameters": {"prefix_cache_bytes": {"string_value": text}}}
        assert _device_memory(text) == EngineSettings.from_config(parameters).prefix_cache_bytes == parse_bytes(text)
    with pytest.raises(KvforgeError, match="above 0"):
        _device_memory("0GB")
