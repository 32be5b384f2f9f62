"""The shapes of the 200 responses, as pydantic models: the OpenAPI schema documents them from here.

``responses`` builds these bodies as plain dicts (fast, no validation per token); these
models only describe them, and the schemathesis test checks every 200 body the server
sends against them.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict


class _Shape(BaseModel):
    model_config = ConfigDict(extra="forbid")


class PromptTokensDetails(_Shape):
    cached_tokens: int


class Usage(_Shape):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class CompletionLogprobs(_Shape):
    tokens: list[str]
    token_logprobs: list[float | None]  # None: an echoed prompt's first token
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class PromptLogprob(_Shape):
    """vLLM's prompt_logprobs entry for one token id at one prompt position."""

    logprob: float
    rank: int | None
    decoded_token: str


# Per prompt token (None for the first): its id's and the top ids' entries, by token id.
PromptLogprobs = list[dict[str, PromptLogprob] | None]


class CompletionChoice(_Shape):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: Literal["stop", "length", "abort"] | None
    stop_reason: str | int | None
    prompt_logprobs: PromptLogprobs | None = None  # with vLLM's prompt_logprobs


class CompletionResponse(_Shape):
    """The whole response of ``/v1/completions``, and each of its stream chunks."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None  # always in a whole response; in chunks only with include_usage


class TopLogprob(_Shape):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(_Shape):
    content: list[ChatTokenLogprob]


class AssistantMessage(_Shape):
    role: Literal["assistant"]
    content: str | None  # None: a reasoning model's answer that was all reasoning
    reasoning_content: str | None = None  # with --reasoning-parser


class ChatChoice(_Shape):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: Literal["stop", "length", "abort"] | None
    stop_reason: str | int | None


class ChatCompletionResponse(_Shape):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: PromptLogprobs | None = None  # with vLLM's prompt_logprobs


class TokenizeResponse(_Shape):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(_Shape):
    prompt: str


class ModelCard(_Shape):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str
    parent: None
    max_model_len: int


class ModelList(_Shape):
    object: Literal["list"]
    data: list[ModelCard]


class VersionResponse(_Shape):
    version: str


class ChatDelta(_Shape):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None  # with --reasoning-parser


class ChatChunkChoice(_Shape):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: Literal["stop", "length", "abort"] | None
    stop_reason: str | int | None = None  # sent with the choice's last chunk


class ChatCompletionChunk(_Shape):
    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None  # null in every chunk but the last with include_usage


# ---- /v1/responses (built by ``response_events``) ------------------------------------------

class OutputText(_Shape):
    type: Literal["output_text"]
    text: str
    annotations: list[None]  # none: pagefleet cites nothing
    logprobs: list[None]  # none: logprobs are not offered on /v1/responses


class ReasoningText(_Shape):
    type: Literal["reasoning_text"]
    text: str


ItemStatus = Literal["in_progress", "completed", "incomplete"]


class OutputMessage(_Shape):
    type: Literal["message"]
    id: str
    status: ItemStatus
    role: Literal["assistant"]
    content: list[OutputText]


class OutputReasoning(_Shape):
    type: Literal["reasoning"]
    id: str
    summary: list[None]
    content: list[ReasoningText]
    status: ItemStatus


class OutputFunctionCall(_Shape):
    type: Literal["function_call"]
    id: str
    call_id: str
    name: str
    arguments: str  # JSON text
    status: ItemStatus


class ResponseUsage(_Shape):
    input_tokens: int
    input_tokens_details: PromptTokensDetails
    output_tokens: int
    output_tokens_details: dict[Literal["reasoning_tokens"], int]
    total_tokens: int


class IncompleteDetails(_Shape):
    reason: Literal["max_output_tokens"]


class ResponseTool(_Shape):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class ResponseObject(_Shape):
    """A ``/v1/responses`` answer, and the ``response`` of its first and last stream events."""

    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["in_progress", "completed", "incomplete"]
    error: None
    incomplete_details: IncompleteDetails | None
    model: str
    output: list[OutputMessage | OutputReasoning | OutputFunctionCall]
    usage: ResponseUsage | None  # None until the response ends
    store: Literal[False]
    background: Literal[False]
    truncation: Literal["disabled"]
    text: dict[Literal["format"], dict[Literal["type"], Literal["text"]]]
    metadata: None
    instructions: str | None
    max_output_tokens: int | None
    temperature: float | None
    top_p: float | None
    tools: list[ResponseTool]
    tool_choice: Literal["none", "auto", "required"] | dict[str, str]
    parallel_tool_calls: bool


class ResponseStreamEvent(BaseModel):
    """One event of a streamed ``/v1/responses``: its ``type`` (also the SSE event's name) says
    which other fields it has (``response``, ``item``, ``part``, ``delta``, ``text``, ...)."""

    model_config = ConfigDict(extra="allow")

    type: str
    sequence_number: int
