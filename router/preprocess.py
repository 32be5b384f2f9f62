"""Request bodies -> token ids and SamplingParams, with every check the worker would make.

Everything a bad request can trip over is found here, in the ingress, so a
bad request never reaches a worker: unknown model, unsupported features,
empty or over-long prompts, token ids outside the vocabulary, chat template
errors, and SamplingParams' own range checks (its ValueError becomes a 400).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagefleet.router.errors import OpenAIError, bad_request, unsupported
from pagefleet.router.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest
from pagefleet.worker.sampling_params import SamplingParams

MAX_LOGPROBS = 20
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


@dataclass(slots=True, frozen=True)
class ModelInfo:
    """What the ingress knows about the served model (read from config.json, no weights)."""

    served_model_name: str
    max_model_len: int
    vocab_size: int
    root: str


@dataclass(slots=True)
class PreparedPrompt:
    token_ids: list[int]
    text: str | None  # None when the client sent token ids


def check_model(requested: str | None, info: ModelInfo) -> None:
    if requested is not None and requested != info.served_model_name:
        raise OpenAIError(f"The model `{requested}` does not exist. This server serves "
                          f"`{info.served_model_name}`.", status_code=404, param="model",
                          code="model_not_found")


def completion_prompts(req: CompletionRequest, tokenizer: Any, info: ModelInfo) -> list[PreparedPrompt]:
    if req.echo:
        raise unsupported("echo is not supported", "echo")
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
    prepared = []
    for item in items:
        if isinstance(item, str):
            ids = tokenizer.encode(item, add_special_tokens=req.add_special_tokens)
            prepared.append(PreparedPrompt(list(ids), item))
        else:
            prepared.append(PreparedPrompt(list(item), None))
    for p in prepared:
        check_prompt_tokens(p.token_ids, info)
    return prepared


def chat_prompt(messages: list[ChatMessage], tokenizer: Any, *, add_generation_prompt: bool,
                continue_final_message: bool = False, add_special_tokens: bool = False) -> PreparedPrompt:
    """Applies the tokenizer's chat template; template text is tokenized without adding
    special tokens again (the template writes its own BOS)."""
    if not messages:
        raise bad_request("messages must not be empty", "messages")
    if continue_final_message and add_generation_prompt:
        raise bad_request("continue_final_message and add_generation_prompt cannot both be true",
                          "continue_final_message")
    conversation = [_plain_message(i, m) for i, m in enumerate(messages)]
    if getattr(tokenizer, "chat_template", None) is None:
        raise bad_request("this model's tokenizer has no chat template; use /v1/completions", "messages")
    try:
        text = tokenizer.apply_chat_template(conversation, tokenize=False,
                                             add_generation_prompt=add_generation_prompt,
                                             continue_final_message=continue_final_message)
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
    out = {"role": message.role, "content": content if content is not None else ""}
    if message.name is not None:
        out["name"] = message.name
    return out


def check_prompt_tokens(token_ids: list[int], info: ModelInfo) -> None:
    if not token_ids:
        raise bad_request("prompt must not be empty", "prompt")
    bad = next((t for t in token_ids if not 0 <= t < info.vocab_size), None)
    if bad is not None:
        raise bad_request(f"token id {bad} is outside the vocabulary [0, {info.vocab_size})", "prompt")
    if len(token_ids) >= info.max_model_len:
        raise bad_request(f"This model's maximum context length is {info.max_model_len} tokens. However, "
                          f"your prompt has {len(token_ids)} tokens, leaving no room for a completion.",
                          "prompt")


def resolve_max_tokens(requested: int | None, prompt_len: int, info: ModelInfo, param: str) -> int:
    """An explicit ``max_tokens`` must fit beside the prompt; None fills the context."""
    room = info.max_model_len - prompt_len
    if requested is None:
        return room
    if isinstance(requested, int) and requested >= 1 and requested > room:
        raise bad_request(
            f"This model's maximum context length is {info.max_model_len} tokens. However, you requested "
            f"{prompt_len + requested} tokens ({prompt_len} in the prompt, {requested} in the completion). "
            "Please reduce the length of the prompt or completion.", param)
    return requested


def completion_sampling_params(req: CompletionRequest, prompt_len: int, info: ModelInfo) -> SamplingParams:
    if req.logprobs is not None and not 0 <= req.logprobs <= MAX_LOGPROBS:
        raise bad_request(f"logprobs must be in [0, {MAX_LOGPROBS}], got {req.logprobs}", "logprobs")
    max_tokens = _checked_max_tokens(req.max_tokens, "max_tokens")
    return _sampling_params(req, resolve_max_tokens(max_tokens, prompt_len, info, "max_tokens"),
                            req.logprobs, info)


def chat_sampling_params(req: ChatCompletionRequest, prompt_len: int, info: ModelInfo) -> SamplingParams:
    if req.tools:
        raise unsupported("tools are not supported", "tools")
    if req.response_format is not None and req.response_format.get("type", "text") != "text":
        raise unsupported("only response_format {'type': 'text'} is supported", "response_format")
    if req.top_logprobs is not None:
        if not req.logprobs:
            raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
        if not 0 <= req.top_logprobs <= MAX_LOGPROBS:
            raise bad_request(f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {req.top_logprobs}",
                              "top_logprobs")
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    max_tokens = _checked_max_tokens(requested, param)
    return _sampling_params(req, resolve_max_tokens(max_tokens, prompt_len, info, param), logprobs, info)


def _checked_max_tokens(value: int | None, param: str) -> int | None:
    if value is not None and value < 1:
        raise bad_request(f"{param} must be at least 1, got {value}", param)
    return value


def _sampling_params(req: CompletionRequest | ChatCompletionRequest, max_tokens: int,
                     logprobs: int | None, info: ModelInfo) -> SamplingParams:
    if req.logit_bias:
        raise unsupported("logit_bias is not supported", "logit_bias")
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options is only allowed when stream is true", "stream_options")
    if req.seed is not None and not _INT64_MIN <= req.seed <= _INT64_MAX:
        raise bad_request("seed must fit in a signed 64-bit integer", "seed")
    stop_token_ids = list(req.stop_token_ids or [])
    bad = next((t for t in stop_token_ids if not 0 <= t < info.vocab_size), None)
    if bad is not None:
        raise bad_request(f"stop token id {bad} is outside the vocabulary", "stop_token_ids")
    if req.min_tokens > max_tokens:
        raise bad_request(f"min_tokens ({req.min_tokens}) must be <= max_tokens ({max_tokens})", "min_tokens")
    stop = req.stop if req.stop is not None else []
    kwargs = dict(
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
        stop_token_ids=stop_token_ids,
        max_tokens=max_tokens,
        min_tokens=req.min_tokens,
        ignore_eos=req.ignore_eos,
        logprobs=logprobs,
        include_stop_str_in_output=req.include_stop_str_in_output,
    )
    try:
        return SamplingParams(**kwargs)
    except (ValueError, TypeError) as exc:
        message = str(exc)
        name = message.split(" ", 1)[0]
        raise bad_request(message, name if name in kwargs else None) from exc
