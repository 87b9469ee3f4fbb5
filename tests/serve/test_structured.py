"""Structured output through `kvforge serve` and `kvforge generate`, over the bundled example model."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.runners.test_decoding import SCHEMA, check_schema
from tests.serve.conftest import KVFORGE, Server, start_server

pytestmark = pytest.mark.slow
MODEL = "out"
MESSAGES = [{"role": "user", "content": "Describe a traffic light as JSON."}]


@pytest.fixture(scope="module")
def server(example_artifact: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = start_server(example_artifact, tmp_path_factory.mktemp("serve") / "serve.log", "--max-num-seqs", "8")
    yield server
    server.terminate()


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60.0)


def test_eight_chat_replies_at_temperature_1_validate_against_the_schema(client: openai.OpenAI) -> None:
    response_format = {"type": "json_schema", "json_schema": {"name": "light", "schema": SCHEMA, "strict": True}}
    for seed in range(8):
        result = client.chat.completions.create(
            model=MODEL, messages=MESSAGES, temperature=1.0, seed=seed, max_tokens=64, response_format=response_format
        )
        choice = result.choices[0]
        assert choice.finish_reason == "stop"  # ended at the grammar's end, not the budget
        assert choice.message.content is not None
        check_schema(json.loads(choice.message.content))


def test_a_reply_cut_by_its_budget_before_the_schema_is_complete_says_so(client: openai.OpenAI) -> None:
    response_format = {"type": "json_schema", "json_schema": {"name": "light", "schema": SCHEMA}}
    ask = dict(model=MODEL, messages=MESSAGES, temperature=0.0, response_format=response_format)
    cut = client.chat.completions.create(max_tokens=3, **ask).choices[0]  # type: ignore[call-overload]
    assert cut.finish_reason == "length" and (cut.model_extra or {})["kvforge"] == {"finish_reason": "incomplete"}
    whole = client.chat.completions.create(max_tokens=64, **ask).choices[0]  # type: ignore[call-overload]
    assert whole.finish_reason == "stop" and "kvforge" not in (whole.model_extra or {})
    chunks = list(client.chat.completions.create(max_tokens=3, stream=True, **ask))  # type: ignore[call-overload]
    last = [c.choices[0] for c in chunks if c.choices and c.choices[0].finish_reason][-1]
    assert last.finish_reason == "length" and (last.model_extra or {})["kvforge"] == {"finish_reason": "incomplete"}
    plain = {k: v for k, v in ask.items() if k != "response_format"}
    free = client.chat.completions.create(max_tokens=3, **plain).choices[0]  # type: ignore[call-overload]
    assert free.finish_reason == "length" and "kvforge" not in (free.model_extra or {})  # no grammar to fall short of


def test_json_object_reply_parses_as_an_object_on_chat_and_completions(client: openai.OpenAI) -> None:
    chat = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, temperature=0.7, seed=1, max_tokens=200, response_format={"type": "json_object"}
    )
    content = chat.choices[0].message.content
    if chat.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(content or ""), dict)
    else:  # the budget ran out first: still a prefix of an object
        assert (content or "").startswith("{")
    stream = client.completions.create(
        model=MODEL,
        prompt="{",
        temperature=1.0,
        seed=2,
        max_tokens=64,
        stream=True,
        extra_body={"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}},
    )
    check_schema(json.loads("".join(c.choices[0].text for c in stream if c.choices)))


@pytest.mark.parametrize(
    ("response_format", "param"),
    [
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}, "response_format"),
        ({"type": "json_schema", "json_schema": {"name": "x"}}, "response_format.json_schema.schema"),
        ({"type": "yaml"}, "response_format"),
        # a json_schema member is checked even where the type does not use it
        ({"type": "text", "json_schema": {"schema": {}, "strict": {}}}, "response_format.json_schema.strict"),
        ({"type": "json_object", "json_schema": {"schema": {}, "name": 3}}, "response_format.json_schema.name"),
    ],
)
def test_schemas_that_do_not_compile_are_bad_requests(client: openai.OpenAI, response_format: dict, param: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            max_tokens=8,
            response_format=response_format,  # type: ignore[arg-type]
        )
    body = info.value.body
    assert isinstance(body, dict) and body["param"] == param


def run_generate(artifact: Path, *args: str) -> subprocess.CompletedProcess[str]:
    command = [str(KVFORGE), "generate", str(artifact), "Describe a traffic light:", "--temperature", "1.0", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=120)


def test_cli_json_schema_regex_and_grammar(example_artifact: Path, tmp_path: Path) -> None:
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(SCHEMA))
    result = run_generate(example_artifact, "--json-schema", str(schema), "--seed", "4")
    assert result.returncode == 0, result.stderr
    check_schema(json.loads(result.stdout))
    result = run_generate(example_artifact, "--regex", "(red|green|amber)-[0-9]{2}", "--seed", "1")
    assert result.returncode == 0 and result.stdout.strip().split("-")[0] in ("red", "green", "amber")
    lark = tmp_path / "light.lark"
    lark.write_text('start: "light is " color\ncolor: "red" | "green"\n')
    result = run_generate(example_artifact, "--grammar", str(lark), "--seed", "2")
    assert result.returncode == 0 and result.stdout.strip() in ("light is red", "light is green")
    schema.write_text('{"type": "strin"}')
    result = run_generate(example_artifact, "--json-schema", str(schema))
    assert result.returncode == 2 and "json_schema" in result.stderr and len(result.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("document", ["Completion", "ChatCompletion"])
def test_the_openapi_document_describes_the_incomplete_extension(document: str) -> None:
    """A choice's `kvforge` field is in the response schemas: what the server sends validates, and
    a value the server never sends does not."""
    import jsonschema_rs

    from kvforge.runners.serve.openapi import openapi_schema
    from kvforge.runners.serve.protocol import EXTENSION

    choice = openapi_schema()["components"]["schemas"][document]["properties"]["choices"]["items"]
    extension = choice["properties"][EXTENSION]
    assert jsonschema_rs.is_valid(extension, {"finish_reason": "incomplete"})
    assert not jsonschema_rs.is_valid(extension, {"finish_reason": "length"})
    assert not jsonschema_rs.is_valid(extension, {})
    assert EXTENSION not in choice["required"]
