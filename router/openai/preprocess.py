"""Request bodies -> token ids and SamplingParams, checked before anything reaches a worker.

This module translates OpenAI's request shapes (prompt forms, chat templates,
``max_completion_tokens``, ``top_logprobs``) and refuses what pagefleet does not
implement; whether a request fits the model and engine is the engine's own
``check_request`` (and SamplingParams' field checks), run here first, so a bad
request gets the same message from the ingress as from ``LLM.generate``.
"""

from __future__ import annotations

import copy
import json
import re
from dataclasses import dataclass, field
from typing import Any, Mapping

from pagefleet.router.openai.chat_template import NoToolSupportError, render_chat
from pagefleet.router.openai.errors import OpenAIError, bad_request, unsupported
from pagefleet.router.openai.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest, ToolDefinition
from pagefleet.router.openai.request_size import (
    DEFAULT_MAX_UNSTREAMED_RESPONSE_TOKENS,
    json_chars,
    message_chars,
    tool_chars,
)
from pagefleet.router.openai.structured import structured_outputs
from pagefleet.router.openai.tool_choice import ToolPlan
from pagefleet.router.openai.vllm_fields import NOT_IMPLEMENTED
from pagefleet.worker.lora.request import LoRAModulePath
from pagefleet.worker.request_check import (
    CONTEXT_LENGTH_EXCEEDED,
    MODEL_NOT_FOUND,
    InvalidRequest,
    RequestLimits,
    check_priority,
    check_request,
)
from pagefleet.worker.sampling_params import SamplingParams, StructuredOutputsParams

DEFAULT_MAX_PROMPTS = 256
DEFAULT_MAX_REQUEST_ID_CHARS = 128
DEFAULT_MAX_CHAT_MESSAGES = 4096
# A tenant name or key id, not a payload: it goes into every block hash of its requests.
MAX_CACHE_SALT_CHARS = 256
# A client's request_id is echoed in headers, logs and every chunk: visible ASCII only.
REQUEST_ID_CHARS = r"[\x21-\x7e]"
_REQUEST_ID = re.compile(REQUEST_ID_CHARS + "+")


@dataclass(slots=True, frozen=True)
class ServingLimits:
    """What one HTTP request may hold beyond what the engine checks (``ServeArgs``' options)."""

    max_prompts_per_request: int = DEFAULT_MAX_PROMPTS  # also sequences: prompts x n
    max_prompt_chars: int | None = None  # None: not checked (the ingress derives one from the tokenizer)
    max_request_id_chars: int = DEFAULT_MAX_REQUEST_ID_CHARS
    max_chat_messages: int = DEFAULT_MAX_CHAT_MESSAGES
    max_unstreamed_response_tokens: int = DEFAULT_MAX_UNSTREAMED_RESPONSE_TOKENS  # n x max_tokens x (1 + logprobs)


@dataclass(slots=True, frozen=True)
class ModelInfo:
    """What the ingress knows about the served model (read from config.json, no weights)."""

    served_model_name: str  # the name /v1/models lists first and responses report
    limits: RequestLimits
    serving: ServingLimits = field(default_factory=ServingLimits)
    block_size: int = 16  # the engines' KV block size: the ingress hashes prompts in these blocks
    more_names: tuple[str, ...] = ()  # further names of --served-model-name, listed after the first
    path_names: tuple[str, ...] = ()  # the checkpoint path as --model gave it: accepted, never listed
    # The blocks one sequence ever holds where every layer slides (kv_cache_sizing.max_blocks_per_seq);
    # None: a sequence holds all it grows to.
    max_blocks_per_seq: int | None = None
    # The LoRA adapters the workers serve from the start (--lora-modules): a request's model may
    # name one, and /v1/models lists each with its parent.
    lora_modules: tuple[LoRAModulePath, ...] = ()

    def accepts(self, name: str) -> bool:
        return name == self.served_model_name or name in self.more_names or name in self.path_names

    def lora_named(self, name: str) -> LoRAModulePath | None:
        return next((m for m in self.lora_modules if m.name == name), None)


def longest_token_chars(tokenizer: Any) -> int:
    """Characters of the vocabulary's longest token string. Byte-level and sentencepiece vocabularies
    spell each byte or character of a token with at least one character, so a text of
    ``max_model_len x this`` characters or more cannot fit in ``max_model_len`` tokens."""
    return max(map(len, tokenizer.get_vocab()), default=1)


def check_request_id(request_id: str | None, info: ModelInfo) -> None:
    if request_id is None:
        return
    limit = info.serving.max_request_id_chars
    if not 0 < len(request_id) <= limit or not _REQUEST_ID.fullmatch(request_id):
        raise bad_request(f"request_id must be 1 to {limit} visible ASCII characters (max_request_id_chars)",
                          "request_id")


def check_prompt_chars(num_chars: int, info: ModelInfo, param: str, what: str = "") -> None:
    """Before rendering or tokenizing: refuse a prompt too long to fit, without spending the
    template's or the tokenizer's time on it."""
    limit = info.serving.max_prompt_chars
    if limit is not None and num_chars > limit:
        raise bad_request(f"a prompt has {num_chars} characters{what}; this server reads at most {limit} before "
                          f"tokenizing (max_prompt_chars; the context is {info.limits.max_model_len} tokens)", param,
                          CONTEXT_LENGTH_EXCEEDED)


@dataclass(slots=True)
class PreparedPrompt:
    token_ids: list[int]
    text: str | None  # None when the client sent token ids


def check_model_name(requested: str | None, info: ModelInfo,
                     runtime: Mapping[str, LoRAModulePath] | None = None) -> LoRAModulePath | None:
    """The LoRA adapter ``requested`` names (None: the base model), served from the start or loaded
    at runtime (``runtime``), or a 404 for a name not served."""
    if requested is None or info.accepts(requested):
        return None
    adapter = info.lora_named(requested) or (runtime or {}).get(requested)
    if adapter is not None:
        return adapter
    names = [m.name for m in info.lora_modules] + sorted(runtime or ())
    adapters = f" and the LoRA adapters {', '.join(f'`{n}`' for n in names)}" if names else ""
    raise OpenAIError(f"The model `{requested}` does not exist. This server serves "
                      f"`{info.served_model_name}`{adapters}.", status_code=404, param="model",
                      code=MODEL_NOT_FOUND)


def completion_prompt_items(req: CompletionRequest, info: ModelInfo) -> list[str | list[int]]:
    """The prompts of a completions request, checked for count and size but not yet tokenized."""
    if req.suffix:
        raise unsupported("suffix is not supported", "suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise unsupported("best_of different from n is not supported", "best_of")
    prompt = req.prompt
    if isinstance(prompt, str):
        items: list[str | list[int]] = [prompt]
    elif prompt and all(isinstance(p, int) for p in prompt):
        items = [list(prompt)]
    else:
        items = list(prompt)
    if not items:
        raise bad_request("prompt must not be empty", "prompt")
    limit = info.serving.max_prompts_per_request
    if len(items) > limit:
        raise bad_request(f"prompt holds {len(items)} prompts; at most {limit} are allowed in one request "
                          "(max_prompts_per_request)", "prompt")
    check_prompt_chars(max((len(p) for p in items if isinstance(p, str)), default=0), info, "prompt")
    return items


def tokenize_prompts(items: list[str | list[int]], tokenizer: Any, add_special_tokens: bool) -> list[PreparedPrompt]:
    prepared = []
    for item in items:
        if isinstance(item, str):
            ids = tokenizer.encode(item, add_special_tokens=add_special_tokens)
            prepared.append(PreparedPrompt(list(ids), item))
        else:
            prepared.append(PreparedPrompt(list(item), None))
    return prepared


def chat_conversation(messages: list[ChatMessage], info: ModelInfo, *, add_generation_prompt: bool,
                      continue_final_message: bool = False, tools: list[ToolDefinition] | None = None) -> list[dict]:
    """The messages as the chat template takes them, checked but not yet rendered: the text of
    the messages and of the ``tools`` the template renders with them against ``max_prompt_chars``."""
    check_message_count(messages, info)
    if continue_final_message and add_generation_prompt:
        raise bad_request("continue_final_message and add_generation_prompt cannot both be true",
                          "continue_final_message")
    chars = sum(message_chars(m) for m in messages)
    check_prompt_chars(chars, info, "messages")
    if tools:
        check_prompt_chars(chars + sum(tool_chars(t) for t in tools), info, "tools", " with its tools")
    return [_plain_message(i, m) for i, m in enumerate(messages)]


def check_message_count(messages: list[ChatMessage] | None, info: ModelInfo) -> None:
    """Before any work that grows with the conversation."""
    if not messages:
        raise bad_request("messages must not be empty", "messages")
    if len(messages) > info.serving.max_chat_messages:
        raise bad_request(f"messages holds {len(messages)} messages; at most {info.serving.max_chat_messages} "
                          "are allowed (max_chat_messages)", "messages")


def template_kwargs_chars(req: ChatCompletionRequest) -> int:
    """The characters of a request's chat_template_kwargs (flags such as enable_thinking), bounded."""
    if not req.chat_template_kwargs:
        return 0
    chars = json_chars(req.chat_template_kwargs, MAX_TEMPLATE_KWARGS_CHARS)
    if chars > MAX_TEMPLATE_KWARGS_CHARS:
        raise bad_request(f"chat_template_kwargs hold more than {MAX_TEMPLATE_KWARGS_CHARS} characters",
                          "chat_template_kwargs")
    reserved = RESERVED_TEMPLATE_NAMES & set(req.chat_template_kwargs)
    if reserved:
        raise bad_request(f"chat_template_kwargs may not set {', '.join(sorted(reserved))}: the request's own "
                          "fields do", "chat_template_kwargs")
    return chars


def chat_prompt(conversation: list[dict], tokenizer: Any, *, add_generation_prompt: bool,
                continue_final_message: bool = False, add_special_tokens: bool = False,
                tools: list[dict] | None = None, template_kwargs: dict[str, Any] | None = None) -> PreparedPrompt:
    """Applies the tokenizer's chat template (with the request's tools, OpenAI-shaped, and its
    chat_template_kwargs as extra template variables); template text is tokenized without adding
    special tokens again (the template writes its own BOS)."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise bad_request("this model's tokenizer has no chat template; use /v1/completions", "messages")
    try:
        text = render_chat(tokenizer, conversation, tools=tools, add_generation_prompt=add_generation_prompt,
                           continue_final_message=continue_final_message, **(template_kwargs or {}))
    except NoToolSupportError as exc:
        raise bad_request(str(exc), "tools") from exc
    except Exception as exc:  # jinja raises TemplateError (e.g. "roles must alternate") and ValueError
        raise bad_request(f"chat template failed: {exc}", "messages") from exc
    ids = tokenizer.encode(text, add_special_tokens=add_special_tokens)
    return PreparedPrompt(list(ids), text)


def _plain_message(index: int, message: ChatMessage) -> dict:
    content = message.content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if part.type != "text":
                raise unsupported(f"content part type {part.type!r} is not supported; only 'text'",
                                  f"messages.[{index}].content.[{j}].type")
            if part.text is None:
                raise bad_request("a text content part needs 'text'", f"messages.[{index}].content.[{j}].text")
            texts.append(part.text)
        content = "\n".join(texts)
    out: dict[str, Any] = {"role": message.role, "content": content if content is not None else ""}
    if message.name is not None:
        out["name"] = message.name
    # Templates test for the keys ("'tool_calls' in message"): present only when they say something.
    if message.role == "assistant" and message.tool_calls:
        out["tool_calls"] = [
            {"id": call.id, "type": call.type,
             "function": {"name": call.function.name, "arguments": _arguments(call.function.arguments)}}
            for call in message.tool_calls]
    if message.role == "tool" and message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    return out


def _arguments(arguments: str | dict) -> str | dict:
    """A call's arguments as templates take them: the object, not its JSON text (Qwen's and Llama's
    templates apply ``tojson`` to it). Text that is not a JSON object stays text."""
    if isinstance(arguments, dict):
        return arguments
    try:
        parsed = json.loads(arguments)
    except json.JSONDecodeError:
        return arguments
    return parsed if isinstance(parsed, dict) else arguments


def completion_sampling_params(req: CompletionRequest) -> SamplingParams:
    # echo with logprobs returns the prompt's logprobs ahead of the output's (lm-eval's
    # loglikelihood); echo with max_tokens 0 returns the prompt alone.
    prompt_logprobs = req.prompt_logprobs
    if req.echo and (req.logprobs is not None or req.max_tokens == 0):
        prompt_logprobs = max(prompt_logprobs or 0, req.logprobs or 0)
    return _sampling_params(req, req.max_tokens, req.logprobs, structured_outputs(req), prompt_logprobs)


def chat_sampling_params(req: ChatCompletionRequest, plan: ToolPlan | None = None) -> SamplingParams:
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    constraint = structured_outputs(req)
    if plan is not None and plan.structured_outputs is not None:
        if constraint is not None:
            raise bad_request("tool_choice forces a tool call, so response_format or structured_outputs cannot "
                              "also constrain the output", "tool_choice")
        constraint = plan.structured_outputs
    if req.prompt_logprobs is not None and req.stream:
        raise unsupported("prompt_logprobs with a streamed chat completion is not supported; ask without "
                          "stream", "prompt_logprobs")
    params = _sampling_params(req, max_tokens, logprobs, constraint, req.prompt_logprobs)
    # A parser that reads special tokens (Mistral's [TOOL_CALLS]) must see them in the text.
    if plan is not None and plan.parser is not None and plan.parser.reads_special_tokens:
        params.skip_special_tokens = False
    return params


def client_field_names(req: CompletionRequest | ChatCompletionRequest) -> dict[str, str]:
    """SamplingParams' field names -> the request's own, where they differ (for ``param``)."""
    if not isinstance(req, ChatCompletionRequest):
        return {}
    names = {"logprobs": "top_logprobs"}
    if req.max_completion_tokens is not None:
        names["max_tokens"] = "max_completion_tokens"
    return names


def check_job(token_ids: list[int], params: SamplingParams, info: ModelInfo,
              req: CompletionRequest | ChatCompletionRequest) -> None:
    """The engine's own request check, as a 400 naming the client's field."""
    try:
        check_request(token_ids, params, info.limits)
    except InvalidRequest as exc:
        raise as_bad_request(exc, req) from exc


def check_request_priority(req: CompletionRequest | ChatCompletionRequest, info: ModelInfo) -> None:
    """The engines' own priority check (``request_check.check_priority``), as a 400."""
    try:
        check_priority(req.priority, info.limits)
    except InvalidRequest as exc:
        raise as_bad_request(exc, req) from exc


def with_max_tokens(params: SamplingParams, prompt_len: int, info: ModelInfo) -> SamplingParams:
    """A request without max_tokens may fill the context: say how far (as vLLM does). A copy, not
    validated again: the request check has just refused a prompt that leaves no room."""
    if params.max_tokens is not None:
        return params
    filled = copy.copy(params)  # the prompts of one request share ``params``
    filled.max_tokens = info.limits.max_model_len - prompt_len
    return filled


# chat_template_kwargs are flags and short values; the arguments the renderer passes itself are
# the request's own fields.
MAX_TEMPLATE_KWARGS_CHARS = 4096
RESERVED_TEMPLATE_NAMES = frozenset({"messages", "conversation", "tools", "documents", "add_generation_prompt",
                                     "continue_final_message", "tokenize", "chat_template", "return_dict",
                                     "return_assistant_tokens_mask", "tokenizer_kwargs"})


def check_not_implemented(req: CompletionRequest | ChatCompletionRequest) -> None:
    """A 400 naming the first of vLLM's fields pagefleet does not implement that the request sets
    to anything but vLLM's default (``vllm_fields``)."""
    api = "chat_completions" if isinstance(req, ChatCompletionRequest) else "completions"
    defaults = NOT_IMPLEMENTED[api]
    for name, value in (req.model_extra or {}).items():
        if name in defaults and value is not None and value != defaults[name]:
            raise unsupported(f"{name} is not supported by this server (only its default, "
                              f"{json.dumps(defaults[name])}, is)", name)


def truncated_prompt(token_ids: list[int], req: CompletionRequest | ChatCompletionRequest,
                     info: ModelInfo) -> list[int]:
    """vLLM's truncate_prompt_tokens: the prompt's last k tokens (truncation_side "right": its
    first k); -1 keeps max_model_len of them."""
    k = req.truncate_prompt_tokens
    if k is None:
        return token_ids
    max_len = info.limits.max_model_len
    if k == -1:
        k = max_len
    if not 1 <= k <= max_len:
        raise bad_request(f"truncate_prompt_tokens must be -1 or between 1 and max_model_len ({max_len}), "
                          f"got {req.truncate_prompt_tokens}", "truncate_prompt_tokens")
    return token_ids[:k] if req.truncation_side == "right" else token_ids[-k:]


def _sampling_params(req: CompletionRequest | ChatCompletionRequest, max_tokens: int | None,
                     logprobs: int | None, constraint: StructuredOutputsParams | None,
                     prompt_logprobs: int | None = None) -> SamplingParams:
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options is only allowed when stream is true", "stream_options")
    stop = req.stop if req.stop is not None else []
    try:
        return SamplingParams(
            n=req.n,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=0 if req.top_k is None else req.top_k,
            min_p=0.0 if req.min_p is None else req.min_p,
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            seed=req.seed,
            stop=[stop] if isinstance(stop, str) else list(stop),
            stop_token_ids=list(req.stop_token_ids or []),
            max_tokens=max_tokens,  # None: until max_model_len
            min_tokens=req.min_tokens,
            ignore_eos=req.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            include_stop_str_in_output=req.include_stop_str_in_output,
            structured_outputs=constraint,
            skip_special_tokens=req.skip_special_tokens,
            logit_bias=req.logit_bias,
            allowed_token_ids=req.allowed_token_ids,
            bad_words=list(req.bad_words or []),
        )
    except InvalidRequest as exc:
        raise as_bad_request(exc, req) from exc


def as_bad_request(exc: InvalidRequest, req: CompletionRequest | ChatCompletionRequest) -> OpenAIError:
    param = client_field_names(req).get(exc.param, exc.param)
    message = str(exc)
    if param != exc.param and message.startswith(f"{exc.param} "):
        message = param + message[len(exc.param):]
    return bad_request(message, param, exc.code)
