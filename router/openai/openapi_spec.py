"""The OpenAPI description of the API: what each route really accepts and what it answers.

The POST routes read their bodies by hand (``http_guards``: content type, size, depth and
surrogates, then the pydantic models of ``protocol``), so FastAPI sees no body parameter
and would document none. This module declares them instead: each request body is its
protocol model's JSON schema, narrowed by the checks the server runs after pydantic
(``SamplingParams``' ranges, the request check's limits with this server's values, the
features refused with 400 ``unsupported``), and each route lists the status codes it can answer, every
error in the one OpenAI error shape (``errors.ErrorResponse``).

What JSON Schema cannot say is left to the server: whether a prompt plus ``max_tokens``
fits the context (answered 400 ``context_length_exceeded``) and what a chat template
refuses (400).
"""

from __future__ import annotations

from typing import Any, Callable

from fastapi import FastAPI
from fastapi.responses import Response
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from pagefleet.router.openai.errors import ErrorResponse
from pagefleet.router.openai.output import response_schema as out
from pagefleet.router.openai.preprocess import (
    MAX_CACHE_SALT_CHARS,
    MAX_TEMPLATE_KWARGS_CHARS,
    REQUEST_ID_CHARS,
    RESERVED_TEMPLATE_NAMES,
    ModelInfo,
)
from pagefleet.router.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ResponsesRequest,
    TokenizeRequest,
)
from pagefleet.router.openai.tool_choice import FUNCTION_NAME, MAX_TOOLS
from pagefleet.worker.sampling_params import (
    INT64_MAX,
    INT64_MIN,
    MAX_BAD_WORD_CHARS,
    MAX_BAD_WORDS,
    MAX_LOGPROBS,
    MAX_TOP_K,
)

_REF = "#/components/schemas/{model}"
_KEY_SCHEME = "APIKey"

_ERRORS = {
    400: "Invalid request: a bad value, type or JSON body, a prompt that does not fit the context, or a feature "
         "pagefleet does not implement (code unsupported)",
    401: "Missing or wrong API key",
    404: "Unknown model",
    413: "Request body over the size limit",
    415: "Body not declared as UTF-8 JSON",
    429: "Admission control refused the request (Retry-After says when to try again)",
    500: "Internal error (the message carries only an error id)",
    503: "No worker can take the request, or the server is draining (Retry-After)",
}


def body_schemas(info: ModelInfo) -> dict[str, dict]:
    """Component schemas of the request bodies, narrowed to what this server accepts."""
    _, top = models_json_schema([(m, "validation") for m in (CompletionRequest, ChatCompletionRequest,
                                                              ResponsesRequest, TokenizeRequest, DetokenizeRequest)],
                                ref_template=_REF)
    schemas = top["$defs"]
    limits = info.limits
    sampling = _sampling_fields(info)
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        schemas[name]["properties"].update(sampling)
    token_id = {"type": "integer", "minimum": 0, "maximum": limits.vocab_size - 1}
    text = {"type": "string", "minLength": 1, **_max_length(info.serving.max_prompt_chars)}
    max_prompts = info.serving.max_prompts_per_request
    completion = schemas["CompletionRequest"]["properties"]
    completion["prompt"] = {"anyOf": [
        text,
        {"type": "array", "items": text, "minItems": 1, "maxItems": max_prompts},
        {"type": "array", "items": token_id, "minItems": 1},
        {"type": "array", "items": {"type": "array", "items": token_id, "minItems": 1}, "minItems": 1,
         "maxItems": max_prompts},
    ], "description": "A prompt, or a list of prompts (text or token ids)"}
    completion["logprobs"] = _nullable({"type": "integer", "minimum": 0, "maximum": MAX_LOGPROBS})
    completion["echo"] = {"type": "boolean", "default": False,
                          "description": "Put the prompt before the output (with logprobs: the prompt's too)"}
    completion["suffix"] = _nullable({"type": "string", "maxLength": 0}, "suffix is not supported (400)")
    completion["best_of"] = _nullable({"type": "integer"}, "Must equal n (400 otherwise)")

    chat = schemas["ChatCompletionRequest"]
    chat["properties"]["messages"].update(minItems=1, maxItems=info.serving.max_chat_messages)
    chat["properties"]["top_logprobs"] = _nullable({"type": "integer", "minimum": 0, "maximum": MAX_LOGPROBS},
                                                   "Needs logprobs: true")
    chat["properties"]["tools"] = _nullable(
        {"type": "array", "items": {"$ref": _REF.format(model="ToolDefinition")}, "maxItems": MAX_TOOLS},
        "Function names must differ; the chat template must read tools (400 otherwise)")
    schemas["FunctionDefinition"]["properties"]["name"] = {"type": "string", "pattern": FUNCTION_NAME.pattern.join("^$")}
    chat["allOf"] = [_requires_true("top_logprobs", "logprobs"),
                     _excludes("continue_final_message", "add_generation_prompt")]
    # null: as many as fit in the context; the completions default is 16, the chat default null.
    completion_tokens = {"type": "integer", "minimum": 1, "maximum": limits.max_model_len - 1}
    for name, model in (("CompletionRequest", CompletionRequest), ("ChatCompletionRequest", ChatCompletionRequest)):
        schemas[name].setdefault("allOf", []).append(_requires_true("stream_options", "stream"))
        schemas[name]["properties"]["max_tokens"] = {
            **_nullable(completion_tokens), "default": model.model_fields["max_tokens"].default}
    chat["properties"]["max_completion_tokens"] = _nullable(completion_tokens, "Takes the place of max_tokens")
    chat["properties"]["chat_template_kwargs"] = _nullable(
        {"type": "object", "propertyNames": {"not": {"enum": sorted(RESERVED_TEMPLATE_NAMES)}}},
        f"Extra chat template variables (e.g. enable_thinking); at most {MAX_TEMPLATE_KWARGS_CHARS} characters")

    # Only text parts (400 for others), and their text is required (400).
    schemas["ContentPart"] = {"type": "object", "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
                              "required": ["type", "text"]}

    _narrow_responses_request(schemas, info, sampling, completion_tokens)

    tokenize = schemas["TokenizeRequest"]
    tokenize["properties"]["prompt"] = _nullable({"type": "string", **_max_length(info.serving.max_prompt_chars)})
    tokenize["properties"]["messages"] = _nullable({"type": "array", "items": {"$ref": _REF.format(
        model="ChatMessage")}, "minItems": 1, "maxItems": info.serving.max_chat_messages})
    tokenize["oneOf"] = [_present("prompt", "messages"), _present("messages", "prompt")]
    schemas["DetokenizeRequest"]["properties"]["tokens"] = {"type": "array", "items": token_id,
                                                            "maxItems": limits.max_model_len}
    return schemas


def _narrow_responses_request(schemas: dict[str, dict], info: ModelInfo, sampling: dict[str, dict],
                              completion_tokens: dict) -> None:
    """/v1/responses: only its declared fields (any other is refused, 400 naming it), each input
    item with the fields its type needs, ``store`` only false."""
    body = schemas["ResponsesRequest"]
    body["additionalProperties"] = False
    props = body["properties"]
    props.update({name: sampling[name] for name in ("model", "temperature", "top_p")})
    props["max_output_tokens"] = _nullable(completion_tokens, "max_tokens of the chat completion it runs as")
    text = {"type": "string", **_max_length(info.serving.max_prompt_chars)}
    props["instructions"] = _nullable(text, "A system message before the input")
    props["store"] = _nullable({"const": False}, "Only false: this server stores no responses")
    string = {"type": "string"}
    parts = {"type": "array", "items": {"$ref": _REF.format(model="ResponsesContentPart")}}
    kinds = [("message", {"role": schemas["ResponsesInputItem"]["properties"]["role"]["anyOf"][0],
                          "content": {"anyOf": [text, parts]}}),
             ("function_call", {"call_id": string, "name": string, "arguments": string}),
             ("function_call_output", {"call_id": string, "output": string})]
    # A message item may leave its type out; the others name theirs.
    items = [{"type": "object", "additionalProperties": False, "required": [*fields] + ([] if kind == "message"
                                                                                       else ["type"]),
              "properties": {"type": {"const": kind}, **fields, "id": _nullable(string),
                             "status": _nullable({"enum": ["in_progress", "completed", "incomplete"]})}}
             for kind, fields in kinds]
    props["input"] = {"anyOf": [text, {"type": "array", "items": {"anyOf": items}, "minItems": 1,
                                                         "maxItems": info.serving.max_chat_messages - 1}]}
    props["tools"] = _nullable({"type": "array", "items": {"$ref": _REF.format(model="ResponsesFunctionTool")},
                                "maxItems": MAX_TOOLS}, "Function tools, whose names must differ")
    schemas["ResponsesFunctionTool"]["properties"]["name"] = {"type": "string",
                                                              "pattern": FUNCTION_NAME.pattern.join("^$")}


def _sampling_fields(info: ModelInfo) -> dict[str, dict]:
    """The fields both generation routes share, with the ranges SamplingParams and the request check allow."""
    limits = info.limits
    stop_string = {"type": "string", "minLength": 1, "maxLength": limits.max_stop_string_chars}
    token_id = {"type": "integer", "minimum": 0, "maximum": limits.vocab_size - 1}
    token_key = {"pattern": "^(0|[1-9][0-9]*)$"}  # below vocab_size (400 otherwise)
    return {
        "model": _nullable({"type": "string"}, "A name /v1/models lists (404 otherwise)"),
        "n": {"type": "integer", "minimum": 1, "maximum": limits.max_num_seqs, "default": 1},
        "stop": _nullable({"anyOf": [stop_string, {"type": "array", "items": stop_string,
                                                   "maxItems": limits.max_stop_strings}]}),
        "stop_token_ids": _nullable({"type": "array", "maxItems": limits.max_stop_token_ids,
                                     "items": {"type": "integer", "minimum": 0, "maximum": limits.vocab_size - 1}}),
        "temperature": _nullable({"type": "number", "minimum": 0}),
        "top_p": _nullable({"type": "number", "exclusiveMinimum": 0, "maximum": 1}),
        "top_k": _nullable({"type": "integer", "minimum": -1, "maximum": MAX_TOP_K}, "-1 or 0: no top-k"),
        "min_p": _nullable({"type": "number", "minimum": 0, "maximum": 1}),
        "presence_penalty": _nullable({"type": "number", "minimum": -2, "maximum": 2}),
        "frequency_penalty": _nullable({"type": "number", "minimum": -2, "maximum": 2}),
        "repetition_penalty": _nullable({"type": "number", "exclusiveMinimum": 0, "maximum": 2}),
        "seed": _nullable({"type": "integer", "minimum": INT64_MIN, "maximum": INT64_MAX}),
        "min_tokens": {"type": "integer", "minimum": 0, "maximum": limits.max_model_len - 1, "default": 0,
                       "description": "At most max_tokens"},
        "logit_bias": _nullable({"type": "object", "propertyNames": token_key, "additionalProperties": {"type": "number"},
                                 "maxProperties": limits.vocab_size},
                                "Token id -> bias added to its logit, clamped to [-100, 100]"),
        "allowed_token_ids": _nullable({"type": "array", "items": token_id, "minItems": 1,
                                        "maxItems": limits.vocab_size}, "Only these tokens may be sampled"),
        "bad_words": _nullable({"type": "array", "items": {"type": "string", "minLength": 1,
                                                           "maxLength": MAX_BAD_WORD_CHARS, "pattern": "\\S"},
                                "maxItems": MAX_BAD_WORDS}, "Words that may not be generated"),
        "truncate_prompt_tokens": _nullable({"type": "integer", "minimum": -1, "maximum": limits.max_model_len,
                                             "not": {"const": 0}},
                                            "Keep the prompt's last k tokens (first k with truncation_side right); "
                                            "-1: max_model_len"),
        "truncation_side": _nullable({"enum": ["left", "right"]}),
        "return_tokens_as_token_ids": _nullable({"type": "boolean"}, "Logprobs name tokens 'token_id:<id>'"),
        "prompt_logprobs": _nullable({"type": "integer", "minimum": 0, "maximum": MAX_LOGPROBS},
                                     "Each prompt token's logprob and the top ones at its position"),
        "request_id": _nullable({"type": "string", "pattern": f"^{REQUEST_ID_CHARS}+$", "minLength": 1,
                                 "maxLength": info.serving.max_request_id_chars},
                                "Echoed as the response id; the server's own id runs the request"),
        "cache_salt": _nullable({"type": "string", "minLength": 1, "maxLength": MAX_CACHE_SALT_CHARS}),
        "priority": ({"type": "integer", "minimum": INT64_MIN, "maximum": INT64_MAX, "default": 0,
                      "description": "Lower is served earlier (--scheduling-policy priority)"}
                     if limits.scheduling_policy == "priority" else
                     {"type": "integer", "const": 0, "default": 0,
                      "description": "Only 0: this server schedules first come, first served"}),
    }


def route_docs(*, request: type[BaseModel] | None = None, ok: type[BaseModel] | None = None,
               ok_media: str | None = "application/json", chunk: type[BaseModel] | None = None,
               events: type[BaseModel] | None = None, errors: tuple[int, ...] = (500,),
               api_key: bool = False) -> dict[str, Any]:
    """Keyword arguments for a route decorator: its request body and every response it can give.
    ``chunk``: the route streams (``stream: true``) chunks of this shape, then ``[DONE]``;
    ``events``: it streams named events of this shape instead; ``ok_media`` None: a 200 has no body."""
    content: dict[str, dict] = {}
    if ok_media is not None:
        content[ok_media] = {"schema": _ref(ok) if ok is not None else {"type": "string"}}
    if chunk is not None:
        content["text/event-stream"] = {"itemSchema": _event_schema(chunk)}
    if events is not None:
        content["text/event-stream"] = {"itemSchema": {"type": "object", "required": ["event", "data"], "properties": {
            "event": {"type": "string"},
            "data": {"type": "string", "contentMediaType": "application/json", "contentSchema": _ref(events)}}}}
    responses: dict[int | str, dict] = {200: {"description": "Success", **({"content": content} if content else {})}}
    for status in sorted({*errors, *((401,) if api_key else ())}):
        responses[status] = {"description": _ERRORS[status], "model": ErrorResponse}
    extra: dict[str, Any] = {"security": [{_KEY_SCHEME: []}]} if api_key else {}
    if request is not None:
        extra["requestBody"] = {"required": True, "content": {"application/json": {"schema": _ref(request)}}}
    docs: dict[str, Any] = {"responses": responses, "response_model": None, "openapi_extra": extra}
    if ok_media is None:
        docs["response_class"] = Response  # not FastAPI's default JSONResponse, which it would document
    return docs


def _event_schema(chunk: type[BaseModel]) -> dict:
    """One server-sent event: a JSON chunk (or an error, once the 200 is sent), then 'data: [DONE]'."""
    return {"type": "object", "required": ["data"], "properties": {"data": {
        "type": "string", "if": {"const": "[DONE]"},
        "else": {"contentMediaType": "application/json",
                 "contentSchema": {"anyOf": [_ref(chunk), _ref(ErrorResponse)]}}}}}


def install_schemas(app: FastAPI, info: ModelInfo, *, api_key: bool = False) -> None:
    """Adds the request and 200 response schemas to the app's OpenAPI components (the error
    schema is FastAPI's own doing: ``responses`` names its model), and the API key's scheme."""
    components = body_schemas(info)
    _, top = models_json_schema([(m, "serialization") for m in (
        out.CompletionResponse, out.ChatCompletionResponse, out.ChatCompletionChunk, out.TokenizeResponse,
        out.DetokenizeResponse, out.ModelList, out.VersionResponse, out.ResponseObject, out.ResponseStreamEvent)],
        ref_template=_REF)
    components.update(top["$defs"])
    generate: Callable[[], dict] = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = generate()  # FastAPI caches it in app.openapi_schema
            schema.setdefault("components", {}).setdefault("schemas", {}).update(components)
            if api_key:
                schema["components"]["securitySchemes"] = {_KEY_SCHEME: {
                    "type": "http", "scheme": "bearer", "description": "The server's --api-key"}}
        return app.openapi_schema

    app.openapi = openapi


def _ref(model: type[BaseModel]) -> dict:
    return {"$ref": _REF.format(model=model.__name__)}


def _nullable(schema: dict, description: str | None = None) -> dict:
    out_schema: dict[str, Any] = {"anyOf": [schema, {"type": "null"}], "default": None}
    if description:
        out_schema["description"] = description
    return out_schema


def _max_length(limit: int | None) -> dict:
    return {} if limit is None else {"maxLength": limit}


def _requires_true(field: str, flag: str) -> dict:
    """``field`` (when present and not null) needs ``flag: true``."""
    return {"if": {"properties": {field: {"not": {"type": "null"}}}, "required": [field]},
            "then": {"properties": {flag: {"const": True}}, "required": [flag]}}


def _excludes(field: str, other: str) -> dict:
    """``field: true`` needs ``other: false`` (``other`` defaults to true)."""
    return {"if": {"properties": {field: {"const": True}}, "required": [field]},
            "then": {"properties": {other: {"const": False}}, "required": [other]}}


def _present(field: str, absent: str) -> dict:
    """``field`` given (not null) and ``absent`` missing or null."""
    return {"properties": {field: {"not": {"type": "null"}}, absent: {"type": "null"}}, "required": [field]}
