"""Loaded by schemathesis (``SCHEMATHESIS_HOOKS``) in the schema test: the one check that differs
from schemathesis' defaults.

``positive_data_acceptance`` wants every request that matches the schema answered 2xx. A few
rules of the API tie one field to another in a way JSON Schema cannot state, so a request the
schema allows can still be refused for them; this check is that built-in check, except that a
refusal for exactly one of these rules, with its own status, field and OpenAI error code or
message, passes. Any other refusal of a schema-valid request still fails.
"""

from __future__ import annotations

import json

import schemathesis
from schemathesis.openapi.checks import RejectedPositiveData
from schemathesis.specs.openapi.checks import positive_data_acceptance

# (status, param, code, message prefix): what each cross-field refusal looks like.
CROSS_FIELD_REFUSALS = (
    # The prompt's tokens plus max_tokens (or min_tokens) must fit the context: the token count
    # is known only after tokenizing.
    (400, None, "context_length_exceeded", ""),
    # min_tokens <= max_tokens (max_tokens defaults to 16 for completions).
    (400, "min_tokens", None, "min_tokens must be <= max_tokens"),
    # The prompts of one request times n: no more sequences than max_prompts_per_request.
    (400, "n", None, "this request asks for"),
    # best_of, an old OpenAI field, is accepted only equal to n.
    (400, "best_of", "unsupported", "best_of different from n"),
    # logit_bias keys are token ids below the vocabulary's size; chat_template_kwargs are bounded in
    # characters (JSON Schema bounds neither a number written as a key nor a value's total text).
    (400, "logit_bias", None, "logit_bias token id"),
    (400, "chat_template_kwargs", None, "chat_template_kwargs hold more than"),
    # prompt_logprobs is refused with a streamed chat completion.
    (400, "prompt_logprobs", "unsupported", "prompt_logprobs with a streamed chat completion"),
    # Tools need a chat template that reads them (a property of the model) and distinct names.
    (400, "tools", None, "this model's chat template has no tool support"),
    (400, "tools", None, "two tools have the same function name"),
    # tool_choice against tools (none given, a name not among them), against response_format
    # (both constrain the output), and "auto" against the server's --enable-auto-tool-choice.
    (400, "tool_choice", None, ""),
    # Exactly one of structured_outputs' fields; what a grammar accepts is xgrammar's to say.
    (400, "structured_outputs", None, "structured_outputs"),
    (400, "structured_outputs", None, "give response_format or structured_outputs, not both"),
    (400, "response_format.json_schema", None, "response_format of type json_schema needs json_schema"),
    (400, "response_format.json_schema.schema", None, "response_format.json_schema.schema"),
)


def is_cross_field_refusal(status: int, body: bytes) -> bool:
    try:
        error = json.loads(body)["error"]
    except (ValueError, KeyError, TypeError):
        return False
    for want_status, param, code, prefix in CROSS_FIELD_REFUSALS:
        if (status == want_status and error.get("code") == code and (param is None or error.get("param") == param)
                and error.get("message", "").startswith(prefix)):
            return True
    return False


@schemathesis.check
def positive_data_accepted_but_cross_field_rules(ctx, response, case):
    try:
        return positive_data_acceptance(ctx, response, case)
    except RejectedPositiveData:
        if is_cross_field_refusal(response.status_code, response.content):
            return None
        raise
