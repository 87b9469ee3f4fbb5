"""Settings declared once (`kvforge.runners.settings`): a sampling field declared on
`SamplingParams` reaches the CLI, the HTTP parser, the OpenAPI document and the Triton contract,
and leaves them when it goes."""

from __future__ import annotations

from dataclasses import make_dataclass, replace
from types import SimpleNamespace
from typing import Any

import click
import pytest
from click.testing import CliRunner

from kvforge.runners import settings
from kvforge.runners.cli import _sampling_options
from kvforge.runners.errors import GenerationError
from kvforge.runners.serve import protocol
from kvforge.runners.serve.openapi import openapi_schema
from kvforge.runners.settings import SamplingParams, Setting, declared, sampling_settings, setting
from kvforge.runners.triton import contract, requests
from kvforge.toolchain.triton import TritonOptions, render_config

_NEW = "typical_p"


def _surfaces() -> dict[str, bool]:
    """Where the new field is found, surface by surface, each derived anew."""
    command = click.command()(_sampling_options(lambda **kwargs: kwargs))
    cli = any(p.name == _NEW and p.opts == ["--typical-p"] for p in command.params)
    schemas = openapi_schema()["components"]["schemas"]
    api = all(_NEW in schemas[name]["properties"] for name in ("CompletionRequest", "ChatCompletionRequest"))
    try:
        protocol._refuse_unsupported({_NEW: 0.5}, chat=False)
        accepted = True
    except protocol.ApiError:
        accepted = False
    triton = any(spec.name == _NEW for spec in contract.inputs())
    config = f'name: "{_NEW}"' in render_config("m", TritonOptions())
    return {
        "cli": cli,
        "openapi": api,
        "protocol": accepted,
        "triton": triton,
        "config.pbtxt": config,
        "triton request": _NEW in requests._same_name(),
    }


def test_a_new_sampling_field_reaches_every_surface_and_leaves_with_it(monkeypatch: pytest.MonkeyPatch) -> None:
    assert not any(_surfaces().values())
    declaration = setting(
        float, 1.0, "Keep the locally typical tokens (1: off).", minimum=0, maximum=1, exclusive_minimum=True
    )
    extended = make_dataclass("SamplingParams", [(_NEW, float, declaration)], bases=(SamplingParams,), frozen=True)
    monkeypatch.setattr(settings, "SamplingParams", extended)
    assert [s.name for s in sampling_settings()][-1] == _NEW
    assert _surfaces() == dict.fromkeys(_surfaces(), True)

    command = click.command()(_sampling_options(lambda **kwargs: kwargs))
    assert CliRunner().invoke(command, ["--typical-p", "0.5"], standalone_mode=False).return_value[_NEW] == 0.5
    schema = openapi_schema()["components"]["schemas"]["CompletionRequest"]["properties"][_NEW]
    assert schema == {"type": "number", "minimum": 0, "exclusiveMinimum": True, "maximum": 1, "nullable": True}
    engine: Any = SimpleNamespace(sampling=lambda **given: replace(extended(), **given))
    assert getattr(protocol._sampling({_NEW: 0.5}, engine), _NEW) == 0.5
    with pytest.raises(protocol.ApiError, match=r"typical_p must be in \(0, 1\], got 1.5") as refused:
        protocol._sampling({_NEW: 1.5}, engine)
    assert refused.value.param == _NEW
    assert contract.TensorSpec(_NEW, "TYPE_FP32", contract.SCALAR, optional=True) in contract.inputs()
    with pytest.raises(GenerationError, match="typical_p must be in"):
        extended(typical_p=0.0).validate()

    monkeypatch.undo()
    assert not any(_surfaces().values())


def test_the_declared_fields_are_the_ones_each_surface_takes() -> None:
    names = [s.name for s in sampling_settings()]
    assert names == ["temperature", "top_k", "top_p", "min_p", "repetition_penalty", "seed"]
    command = click.command()(_sampling_options(lambda **kwargs: kwargs))
    assert [p.name for p in command.params] == names
    assert [s.name for s in contract.sampling_inputs()] == names
    types = {s.name: s.data_type for s in contract.sampling_inputs()}
    assert types == {
        "temperature": "TYPE_FP32",
        "top_k": "TYPE_INT32",
        "top_p": "TYPE_FP32",
        "min_p": "TYPE_FP32",
        "repetition_penalty": "TYPE_FP32",
        "seed": "TYPE_UINT64",
    }
    properties = openapi_schema()["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    assert properties["top_k"]["minimum"] == -1  # vLLM's "off", which the parser maps to 0
    assert properties["min_p"] == {"type": "number", "minimum": 0, "maximum": 1, "nullable": True}


@pytest.mark.parametrize(
    ("declaration", "value", "message"),
    [
        (Setting("n", int, 0, "", minimum=0), -1, "n must be >= 0, got -1"),
        (Setting("n", int, 0, "", minimum=0), 1.5, "n must be an integer, got 1.5"),
        (
            Setting("x", float, 1.0, "", minimum=0, exclusive_minimum=True, note="1: off"),
            0,
            r"x must be > 0 \(1: off\)",
        ),
        (Setting("x", float, 0.0, "", minimum=0, maximum=1), float("nan"), "x must be finite"),
        (Setting("x", float, 0.0, "", minimum=0, maximum=1), True, "x must be a number, got True"),
        (Setting("s", int, None, "", minimum=0, nullable=True), -2, "s must be >= 0 or None, got -2"),
    ],
)
def test_a_check_names_the_setting_its_range_and_the_value(declaration: Setting, value: object, message: str) -> None:
    with pytest.raises(GenerationError, match=message):
        declaration.check(value, GenerationError)


def test_serving_settings_are_the_triton_parameters_and_the_cli_options() -> None:
    from kvforge.runners.cli import generate, serve
    from kvforge.runners.speculative import MAX_DRAFT_TOKENS
    from kvforge.toolchain.cli import export_triton

    assert contract.ENGINE_PARAMETERS == {"max_num_seqs": 8, "max_queued": 64, "prefill_chunk": 256}
    declarations = {s.name: s for s in declared(settings.ServingParams)}
    options = {p.name: p for p in serve.params if isinstance(p, click.Option)}
    for name, declaration in declarations.items():
        option = options[name]
        assert (option.opts, option.default) == ([declaration.flag], declaration.default), name
    assert (options["draft_tokens"].type.min, options["draft_tokens"].type.max) == (1, MAX_DRAFT_TOKENS)  # type: ignore[attr-defined]
    assert options["max_queued"].type.min == 0  # type: ignore[attr-defined]
    taken = (
        {p.name for p in generate.params} & set(declarations),
        {p.name for p in export_triton.params} & set(declarations),
    )
    assert taken == ({"speculative", "draft_tokens"}, {*contract.ENGINE_PARAMETERS, "prefix_cache_bytes"})
