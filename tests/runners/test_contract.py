"""The contract reader refuses malformed io sections before deriving anything from them."""

from __future__ import annotations

import numpy as np
import pytest

from kvforge.runners.contract import IO_LIMITS, DecoderIO
from kvforge.runners.errors import ArtifactError

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


def _old_io(positions: str, logits_dims: list[object]) -> dict[str, object]:
    """An io section as a build before `keep` wrote it (one layer, literal)."""
    kv = ["batch", 2, "past", 16]
    return {
        "num_layers": 1,
        "num_kv_heads": 2,
        "head_dim": 16,
        "vocab_size": 384,
        "kv_dtype": "float32",
        "logits_dtype": "float32",
        "kv_mode": "concat",
        "logits_positions": positions,
        "inputs": [
            {"name": "input_ids", "dtype": "int64", "dims": ["batch", "seq"]},
            {"name": "attention_mask", "dtype": "int64", "dims": ["batch", "total"]},
            {"name": "position_ids", "dtype": "int64", "dims": ["batch", "seq"]},
            {"name": "past_key_values.0.key", "dtype": "float32", "dims": kv},
            {"name": "past_key_values.0.value", "dtype": "float32", "dims": kv},
        ],
        "outputs": [
            {"name": "logits", "dtype": "float32", "dims": logits_dims},
            {"name": "present.0.key", "dtype": "float32", "dims": ["batch", 2, "total", 16]},
            {"name": "present.0.value", "dtype": "float32", "dims": ["batch", 2, "total", 16]},
        ],
    }


@pytest.mark.parametrize(("positions", "dims"), [("last", ["batch", 1, 384]), ("all", ["batch", "seq", 384])])
def test_older_last_and_all_sections_load_unchanged(positions: str, dims: list[object]) -> None:
    data = _old_io(positions, dims)
    io = DecoderIO.from_dict(data)
    assert io.logits_positions == positions and not io.keeps_logits
    assert io.to_dict() == data
    assert "logits_to_keep" not in [t.name for t in io.inputs]


def test_keep_takes_logits_to_keep_and_returns_that_many_positions() -> None:
    data = _old_io("keep", ["batch", "kept", 384])
    data["inputs"] = [*data["inputs"], {"name": "logits_to_keep", "dtype": "int64", "dims": [1]}]  # type: ignore[misc]
    io = DecoderIO.from_dict(data)
    assert io.keeps_logits and io.to_dict() == data
    ids = np.zeros((2, 5), np.int64)
    assert io.logits_rows({"input_ids": ids}) == 1  # not fed: the last position, which OrtSession feeds then
    assert [io.logits_rows({"input_ids": ids, "logits_to_keep": np.array([k])}) for k in (1, 3, 5, 9, 0)] == [
        1,
        3,
        5,
        5,  # more than were fed: the slice stops at the first position
        5,  # 0: Slice(-0) starts at the first position too
    ]
    without = {**data, "inputs": data["inputs"][:-1]}  # type: ignore[index]
    with pytest.raises(ArtifactError, match="does not match the contract"):
        DecoderIO.from_dict(without)


def test_fixed_positions_ignore_logits_to_keep() -> None:
    ids = np.zeros((1, 4), np.int64)
    fed = {"input_ids": ids, "logits_to_keep": np.array([2])}
    assert DecoderIO.from_dict(_old_io("all", ["batch", "seq", 384])).logits_rows(fed) == 4
    assert DecoderIO.from_dict(_old_io("last", ["batch", 1, 384])).logits_rows(fed) == 1


def test_unknown_logits_positions_is_refused() -> None:
    with pytest.raises(ArtifactError, match="io.logits_positions 'first' is not one of all, last, keep"):
        DecoderIO.from_dict(_old_io("first", ["batch", 1, 384]))
