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


MLA = DecoderIO(num_layers=2, num_kv_heads=1, head_dim=16, vocab_size=384, value_head_dim=8)


def test_values_narrower_than_keys_round_trip_and_shape_the_cache() -> None:
    assert DecoderIO.from_dict(MLA.to_dict()) == MLA
    assert "value_head_dim" not in GOOD.to_dict()  # manifests of ordinary models are unchanged
    dims = {t.name: t.dims for t in MLA.inputs}
    assert dims["past_key_values.1.key"] == ("batch", 1, "past", 16)
    assert dims["past_key_values.1.value"] == ("batch", 1, "past", 8)
    assert MLA.kv_shape("present.0.value", 3, 10) == (3, 1, 10, 8)
    assert MLA.kv_bytes_by_kind(1) == {"full": 2 * 1 * (16 + 8) * 4}


@pytest.mark.parametrize("value", [0, True, 1 << 17, "8"])
def test_malformed_value_head_dim_is_refused(value: object) -> None:
    with pytest.raises(ArtifactError, match="io.value_head_dim"):
        DecoderIO.from_dict({**MLA.to_dict(), "value_head_dim": value})
