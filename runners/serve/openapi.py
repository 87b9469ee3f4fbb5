"""The OpenAPI 3.0 description of the server, served at GET /openapi.json.

It lists the fields this server reads (a field it does not implement is refused with a 400) with the ranges it
accepts, and every status each route answers with, so that schema-driven testers can check
the server against it.
"""

from __future__ import annotations

from typing import Any

from kvforge.runners.settings import sampling_settings

_JSON = "application/json"


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _nullable(schema: dict[str, Any]) -> dict[str, Any]:
    return {**schema, "nullable": True}


def _error(description: str) -> dict[str, Any]:
    return {"description": description, "content": {_JSON: {"schema": _ref("ErrorResponse")}}}


_ERRORS = {
    "400": _error("Invalid request (field named in error.param), or context_length_exceeded."),
    "404": _error("Unknown model (code model_not_found)."),
    "429": _error("Every batch slot and queue place is taken; see Retry-After."),
    "500": _error("The engine failed while generating this request."),
    "503": _error("Loading, shutting down, or the engine has failed."),
}

# What both generation requests take besides the sampling fields (`_generation_fields`).
_GENERATION: dict[str, Any] = {
    "max_tokens": _nullable({"type": "integer", "minimum": 1}),
    "max_completion_tokens": _nullable({"type": "integer", "minimum": 1}),
    "n": _nullable({"type": "integer", "minimum": 1}),
    "response_format": _nullable(
        {
            "type": "object",
            "required": ["type"],
            "properties": {
                "type": {"type": "string", "enum": ["text", "json_object", "json_schema"]},
                "json_schema": {
                    "type": "object",
                    "required": ["schema"],
                    "properties": {
                        "name": {"type": "string"},
                        "schema": {"type": "object"},
                        "strict": _nullable({"type": "boolean"}),
                    },
                },
            },
        }
    ),
    "stop": _nullable(
        {
            "oneOf": [
                {"type": "string", "minLength": 1},
                {"type": "array", "items": {"type": "string", "minLength": 1}, "maxItems": 16},
            ]
        }
    ),
    "stream": _nullable({"type": "boolean"}),
    "ignore_eos": _nullable({"type": "boolean"}),
    "stream_options": _nullable({"type": "object", "properties": {"include_usage": _nullable({"type": "boolean"})}}),
}


def _generation_fields() -> dict[str, Any]:
    """The fields of both generation requests: every sampling field `SamplingParams` declares,
    with its range (`kvforge.runners.settings`), and the rest."""
    return {**{s.name: s.json_schema() for s in sampling_settings()}, **_GENERATION}


_USAGE = {
    "type": "object",
    "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
    "properties": {
        k: {"type": "integer", "minimum": 0} for k in ("prompt_tokens", "completion_tokens", "total_tokens")
    },
}
_FINISH = {"type": "string", "enum": ["stop", "length"]}
# One server-sent event: a JSON chunk (or an error) in data, then data: [DONE].
_SSE_EVENT = {
    "type": "object",
    "required": ["data"],
    "properties": {"data": {"type": "string", "minLength": 1}, "event": {"type": "string", "enum": ["message"]}},
}


# A choice's field of kvforge's own (`protocol.EXTENSION`), present only where it says something
_EXTENSION: dict[str, Any] = {
    "type": "object",
    "description": "kvforge's own: finish_reason 'incomplete' where the reply stopped at its token budget "
    "(finish_reason 'length') before its response_format was complete, so it does not match it.",
    "required": ["finish_reason"],
    "properties": {"finish_reason": {"type": "string", "enum": ["incomplete"]}},
}


def _response(object_name: str, choice: dict[str, Any]) -> dict[str, Any]:
    """A non-streamed response: `choice` holds what each choice carries besides its index and finish reason."""
    return {
        "type": "object",
        "required": ["id", "object", "created", "model", "choices", "usage"],
        "properties": {
            "id": {"type": "string"},
            "object": {"type": "string", "enum": [object_name]},
            "created": {"type": "integer"},
            "model": {"type": "string"},
            "choices": {
                "type": "array",
                "items": {
                    "type": "object",
                    "required": ["index", *choice, "finish_reason"],
                    "properties": {
                        "index": {"type": "integer"},
                        **choice,
                        "finish_reason": _FINISH,
                        "kvforge": _EXTENSION,
                    },
                },
            },
            "usage": _USAGE,
        },
    }


_MESSAGES: dict[str, Any] = {
    "type": "array",
    "minItems": 1,
    "items": {
        "type": "object",
        "required": ["role"],
        "properties": {
            "role": {"type": "string", "minLength": 1},
            "content": _nullable({"oneOf": [{"type": "string"}, {"type": "array", "items": _ref("TextPart")}]}),
        },
    },
}


def _post(summary: str, request: str, response: str) -> dict[str, Any]:
    """A plain JSON route: its request and response schemas, and the errors it answers with."""
    return {
        "post": {
            "summary": summary,
            "requestBody": {"required": True, "content": {_JSON: {"schema": _ref(request)}}},
            "responses": {
                "200": {"description": "The result.", "content": {_JSON: {"schema": _ref(response)}}},
                **{status: _ERRORS[status] for status in ("400", "404", "503")},
            },
        }
    }


def _tokenize_schemas(name: dict[str, Any]) -> dict[str, Any]:
    """POST /tokenize (a prompt, or a conversation rendered with the chat template) and POST
    /detokenize, in vLLM's shapes; a field neither variant lists is refused."""
    flag = _nullable({"type": "boolean"})
    return {
        "TokenizeRequest": {"oneOf": [_ref("TokenizeCompletionRequest"), _ref("TokenizeChatRequest")]},
        "TokenizeCompletionRequest": {
            "type": "object",
            "required": ["prompt"],
            "additionalProperties": False,
            "properties": {
                "model": name,
                "prompt": {"type": "string"},
                "add_special_tokens": flag,
                "return_token_strs": flag,
            },
        },
        "TokenizeChatRequest": {
            "type": "object",
            "required": ["messages"],
            "additionalProperties": False,
            "properties": {
                "model": name,
                "messages": _MESSAGES,
                "add_generation_prompt": flag,
                "add_special_tokens": flag,
                "return_token_strs": flag,
            },
        },
        "TokenizeResponse": {
            "type": "object",
            "required": ["count", "max_model_len", "tokens", "token_strs"],
            "properties": {
                "count": {"type": "integer"},
                "max_model_len": {"type": "integer"},
                "tokens": {"type": "array", "items": {"type": "integer"}},
                "token_strs": _nullable({"type": "array", "items": {"type": "string"}}),
            },
        },
        "DetokenizeRequest": {
            "type": "object",
            "required": ["tokens"],
            "additionalProperties": False,
            "properties": {"model": name, "tokens": {"type": "array", "items": {"type": "integer", "minimum": 0}}},
        },
        "DetokenizeResponse": {"type": "object", "required": ["prompt"], "properties": {"prompt": {"type": "string"}}},
    }


def _generation_route(summary: str, request: str, response: str) -> dict[str, Any]:
    return {
        "post": {
            "summary": summary,
            "requestBody": {"required": True, "content": {_JSON: {"schema": _ref(request)}}},
            "responses": {
                "200": {
                    "description": "The completion; with stream: true, server-sent events ending in data: [DONE].",
                    "content": {_JSON: {"schema": _ref(response)}, "text/event-stream": {"schema": _SSE_EVENT}},
                },
                **_ERRORS,
            },
        }
    }


def openapi_schema(model: str | None = None) -> dict[str, Any]:
    """The document; with `model`, requests name it (an enum), so generated ones reach the engine."""
    name: dict[str, Any] = {"type": "string", **({"enum": [model]} if model else {})}
    generation = _generation_fields()
    return {
        "openapi": "3.0.3",
        "info": {"title": "kvforge serve", "version": "1", "description": "OpenAI-compatible completions."},
        "paths": {
            "/v1/completions": _generation_route("Complete a prompt.", "CompletionRequest", "Completion"),
            "/v1/chat/completions": _generation_route(
                "Answer a conversation, formatted with the model's chat template.",
                "ChatCompletionRequest",
                "ChatCompletion",
            ),
            "/tokenize": _post(
                "Token ids of a prompt, or of a conversation rendered with the model's chat template.",
                "TokenizeRequest",
                "TokenizeResponse",
            ),
            "/detokenize": _post("The text of token ids.", "DetokenizeRequest", "DetokenizeResponse"),
            "/v1/models": {
                "get": {
                    "summary": "The served model, with its context length (max_model_len).",
                    "responses": {
                        "200": {"description": "One model.", "content": {_JSON: {"schema": _ref("ModelList")}}},
                        "503": _ERRORS["503"],
                    },
                }
            },
            "/health": {
                "get": {
                    "summary": "200 when ready; 503 while loading, shutting down or after an engine failure.",
                    "responses": {
                        "200": {"description": "Ready.", "content": {_JSON: {"schema": {"type": "object"}}}},
                        "503": _ERRORS["503"],
                    },
                }
            },
            "/metrics": {
                "get": {
                    "summary": "Prometheus metrics (text exposition format).",
                    "responses": {
                        "200": {"description": "Metrics.", "content": {"text/plain": {"schema": {"type": "string"}}}}
                    },
                }
            },
        },
        "components": {
            "schemas": {
                "ErrorResponse": {
                    "type": "object",
                    "required": ["error"],
                    "properties": {
                        "error": {
                            "type": "object",
                            "required": ["message", "type", "param", "code"],
                            "properties": {
                                "message": {"type": "string"},
                                "type": {"type": "string"},
                                "param": _nullable({"type": "string"}),
                                "code": _nullable({"type": "string"}),
                            },
                        }
                    },
                },
                "TextPart": {
                    "type": "object",
                    "required": ["type", "text"],
                    "properties": {"type": {"type": "string", "enum": ["text"]}, "text": {"type": "string"}},
                },
                "CompletionRequest": {
                    "type": "object",
                    "required": ["model", "prompt"],
                    "properties": {
                        "model": name,
                        "prompt": {
                            "oneOf": [
                                {"type": "string", "minLength": 1},
                                {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1},
                            ]
                        },
                        **generation,
                        "logprobs": _nullable({"type": "integer", "minimum": 0, "maximum": 20}),
                    },
                },
                "ChatCompletionRequest": {
                    "type": "object",
                    "required": ["model", "messages"],
                    "properties": {
                        "model": name,
                        "messages": _MESSAGES,
                        **generation,
                        "logprobs": _nullable({"type": "boolean"}),
                        "top_logprobs": _nullable({"type": "integer", "minimum": 0, "maximum": 20}),
                    },
                },
                "Completion": _response("text_completion", {"text": {"type": "string"}}),
                "ChatCompletion": _response(
                    "chat.completion",
                    {
                        "message": {
                            "type": "object",
                            "required": ["role", "content"],
                            "properties": {"role": {"type": "string"}, "content": {"type": "string"}},
                        }
                    },
                ),
                **_tokenize_schemas(name),
                "ModelList": {
                    "type": "object",
                    "required": ["object", "data"],
                    "properties": {
                        "object": {"type": "string"},
                        "data": {
                            "type": "array",
                            "items": {
                                "type": "object",
                                "required": ["id", "object", "max_model_len"],
                                "properties": {
                                    "id": {"type": "string"},
                                    "object": {"type": "string"},
                                    "max_model_len": {"type": "integer"},
                                },
                            },
                        },
                    },
                },
            }
        },
    }
