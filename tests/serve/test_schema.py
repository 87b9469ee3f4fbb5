"""The server against its own OpenAPI document, with schemathesis: valid and invalid requests
generated from the schema get documented statuses, content types and bodies, invalid ones
are rejected with a 4xx, and nothing is a server error."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error
from schemathesis.generation.modes import GenerationMode
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_schema_conformance,
    status_code_conformance,
)

from tests.serve.conftest import Server

pytestmark = pytest.mark.slow
# Not positive_data_acceptance: a request valid by the schema may still be refused with a
# 400 the schema documents (a prompt past the context, a token id past the vocabulary).
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
    negative_data_rejection,
]


@pytest.fixture(scope="module")
def api_schema(shared_server: Server) -> schemathesis.BaseSchema:
    return schemathesis.openapi.from_url(shared_server.url + "/openapi.json")


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_the_api_conforms_to_its_schema(api_schema: schemathesis.BaseSchema, mode: GenerationMode) -> None:
    operations = [result.ok() for result in api_schema.get_all_operations()]  # type: ignore[union-attr]
    assert {op.label for op in operations} >= {"POST /v1/completions", "POST /v1/chat/completions", "GET /health"}
    for operation in operations:
        if mode == GenerationMode.NEGATIVE and operation.method.upper() != "POST":
            continue  # a GET without parameters has no invalid form

        @given(case=operation.as_strategy(generation_mode=mode))
        @settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        def check(case: schemathesis.Case) -> None:
            case.call_and_validate(timeout=60, checks=CHECKS)

        check()
