"""A request's ``response_format`` or ``structured_outputs`` -> the engine's ``StructuredOutputsParams``."""

from __future__ import annotations

import json

from pagefleet.router.openai.errors import bad_request
from pagefleet.router.openai.protocol import ChatCompletionRequest, CompletionRequest
from pagefleet.worker.request_check import InvalidRequest
from pagefleet.worker.sampling_params import StructuredOutputsParams


def structured_outputs(req: CompletionRequest | ChatCompletionRequest) -> StructuredOutputsParams | None:
    """What constrains the request's output (None: nothing). Raises a 400 naming the client's field."""
    fmt, fields = req.response_format, req.structured_outputs
    if fmt is not None and fmt.type != "text":
        if fields is not None:
            raise bad_request("give response_format or structured_outputs, not both", "structured_outputs")
        if fmt.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        if fmt.json_schema is None:
            raise bad_request("response_format of type json_schema needs json_schema", "response_format.json_schema")
        schema = fmt.json_schema.schema_
        return _checked(lambda: StructuredOutputsParams(json=json.dumps(schema)) if schema is not None
                        else StructuredOutputsParams(json_object=True), "response_format.json_schema.schema")
    if fields is None:
        return None
    schema = fields.json_
    return _checked(lambda: StructuredOutputsParams(
        json=schema if isinstance(schema, str) or schema is None else json.dumps(schema), regex=fields.regex,
        choice=fields.choice, grammar=fields.grammar, json_object=bool(fields.json_object)), "structured_outputs")


def _checked(make, param: str) -> StructuredOutputsParams:
    try:
        return make()
    except InvalidRequest as exc:
        message = str(exc)
        if message.startswith("structured_outputs"):
            message = param + message[len("structured_outputs"):]
        raise bad_request(message, param) from exc
