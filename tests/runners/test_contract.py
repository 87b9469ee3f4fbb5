"""The contract reader refuses malformed io sections before deriving anything from them."""

from __future__ import annotations

import pytest

from runners.contract import IO_LIMITS, DecoderIO
from runners.errors import ArtifactError

GOOD = DecoderIO(num_layers=2, num_kv_heads=2, head_dim=16, vocab_size=384)


def test_round_trip() -> None:
    assert DecoderIO.from_dict(GOOD.to_dict()) == GOOD


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("num_layers", 10**9, "io.num_layers must be an integer in"),
        ("num_layers", float("inf"), "io.num_layers"),
        ("head_dim", True, "io.head_dim"),
        ("vocab_size", 0, "io.vocab_size"),
        ("kv_dtype", "float64x", "io.kv_dtype"),
        ("kv_mode", "paged", "io.kv_mode"),
        ("inputs", [], "does not match the contract"),
    ],
)
def test_malformed_fields_are_refused(field: str, value: object, message: str) -> None:
    data = {**GOOD.to_dict(), field: value}
    with pytest.raises(ArtifactError, match=message):
        DecoderIO.from_dict(data)


def test_missing_field_is_named() -> None:
    data = GOOD.to_dict()
    del data["kv_mode"]
    with pytest.raises(ArtifactError, match="io.kv_mode is missing"):
        DecoderIO.from_dict(data)


def test_limits_cover_every_size() -> None:
    assert set(IO_LIMITS) == {"num_layers", "num_kv_heads", "head_dim", "vocab_size"}
