"""The OpenAI request bodies pagefleet accepts, as strict pydantic models.

Strict: ``"5"`` is not an integer and ``1`` is not a boolean, as with OpenAI.
Every field of vLLM's request models is either one of these models' fields, implemented with
vLLM's semantics, or in ``vllm_fields.NOT_IMPLEMENTED``: refused with a 400 naming it when a
client sets it to anything but vLLM's default (``preprocess.check_not_implemented``), never
silently dropped. Other unknown fields are ignored (clients send many).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

PROMPT_SHAPES = "a string, a list of strings, a list of token ids, or a list of token id lists"


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Body):
    include_usage: bool = False


class JsonSchemaFormat(_Body):
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    """OpenAI's ``response_format``."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(_Body):
    """vLLM's ``structured_outputs``: one of these constrains the output."""

    json_: str | dict[str, Any] | bool | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class _SamplingFields(_Body):
    """Fields shared by /v1/completions and /v1/chat/completions (vLLM's extras included)."""

    # Unknown fields are kept (``model_extra``) so that vLLM's unimplemented ones can be refused.
    model_config = ConfigDict(strict=True, extra="allow")

    model: str | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    skip_special_tokens: bool = True
    # vLLM's: keep the prompt's last (truncation_side "left", the default) or first k tokens; -1
    # keeps max_model_len of them.
    truncate_prompt_tokens: int | None = None
    truncation_side: Literal["left", "right"] | None = None
    # vLLM's: logprobs name their tokens "token_id:<id>" instead of the token's text.
    return_tokens_as_token_ids: bool | None = None
    # vLLM's: each prompt token's logprob and the top ones at its position.
    prompt_logprobs: int | None = None
    request_id: str | None = None
    # vLLM's: goes into the prefix-cache hashes, so requests with different salts never share
    # (nor can time) each other's cached blocks. One salt per tenant.
    cache_salt: str | None = None
    # vLLM's: lower is served earlier (and preempted later) under --scheduling-policy priority;
    # anything but 0 is refused by a server that schedules fcfs. The X-Vllm-Priority header, when
    # it holds an integer, replaces it (app.py), as in vLLM.
    priority: int = 0
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None


class CompletionRequest(_SamplingFields):
    prompt: Any
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    add_special_tokens: bool = True

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, value: Any) -> str | list[str] | list[int] | list[list[int]]:
        if isinstance(value, str):
            return value
        if isinstance(value, list):
            if all(isinstance(v, str) for v in value):
                return value
            if all(_is_token_id(v) for v in value):
                return value
            if all(isinstance(v, list) and all(_is_token_id(t) for t in v) for v in value):
                return value
        raise ValueError(f"prompt must be {PROMPT_SHAPES}")


class ContentPart(_Body):
    type: str
    text: str | None = None


class FunctionCall(_Body):
    name: str
    arguments: str | dict[str, Any]  # OpenAI sends JSON text; some clients send the object


class AssistantToolCall(_Body):
    """A call an earlier assistant turn made, sent back in the conversation."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None  # None: "" (an assistant turn that only calls tools)
    name: str | None = None
    tool_calls: list[AssistantToolCall] | None = None  # read on assistant messages only
    tool_call_id: str | None = None  # read on tool messages only: the call this result answers


class FunctionDefinition(_Body):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(_Body):
    type: Literal["function"]
    function: FunctionDefinition


class ToolChoiceFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: ToolChoiceFunction


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # vLLM's: extra variables for the chat template (Qwen3's enable_thinking, ...).
    chat_template_kwargs: dict[str, Any] | None = None


class _ResponsesBody(_Body):
    """/v1/responses refuses what it would otherwise ignore: unknown fields are a 400 naming them."""

    model_config = ConfigDict(strict=True, extra="forbid")


class ResponsesContentPart(_ResponsesBody):
    """A text part of a Responses input message (``output_text``: an earlier answer sent back)."""

    type: Literal["input_text", "output_text"]
    text: str


class ResponsesInputItem(_ResponsesBody):
    """One item of a Responses ``input`` list: a message, or a function call an earlier answer
    made and its output, sent back in the conversation."""

    type: Literal["message", "function_call", "function_call_output"] = "message"
    role: Literal["system", "developer", "user", "assistant"] | None = None  # messages'
    content: str | list[ResponsesContentPart] | None = None  # messages'
    call_id: str | None = None  # function_call's and function_call_output's
    name: str | None = None  # function_call's
    arguments: str | None = None  # function_call's
    output: str | None = None  # function_call_output's
    id: str | None = None  # the item id an earlier answer gave it (not read)
    status: Literal["in_progress", "completed", "incomplete"] | None = None  # likewise


class ResponsesFunctionTool(_ResponsesBody):
    """A Responses function tool: the chat API's function definition, one level up."""

    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ResponsesToolChoiceFunction(_ResponsesBody):
    type: Literal["function"]
    name: str


class ResponsesRequest(_Body):
    """``POST /v1/responses``: run as a chat completion (``responses_api``). Nothing is stored, so
    ``store: true``, ``previous_response_id`` and ``background`` are refused; so is any field not
    declared here (kept in ``model_extra`` to be named in the 400)."""

    model_config = ConfigDict(strict=True, extra="allow")

    model: str | None = None
    input: str | list[ResponsesInputItem]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    tools: list[ResponsesFunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ResponsesToolChoiceFunction | None = None
    parallel_tool_calls: bool | None = None
    store: bool | None = None


class TokenizeRequest(_Body):
    """vLLM's /tokenize: either ``prompt`` (completion style) or ``messages`` (chat style)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    return_token_strs: bool = False
    tools: list[ToolDefinition] | None = None  # rendered into the chat template with the messages


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
