"""Engine deltas -> OpenAI response bodies and stream chunks (plain dicts, ready for JSON).

One ``ResponseBuilder`` per HTTP request: it knows the response id, model name
and creation time, and turns token ids in logprobs into the token strings
OpenAI clients expect.
"""

from __future__ import annotations

import json
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

from pagefleet.router.openai.output.reasoning import ReasoningParser
from pagefleet.worker.outputs import CompletionOutput, RequestOutputDelta, TokenLogprob, append_output

# Logprobs written into a non-streamed body at a time (``full_response_json``).
LOGPROBS_CHUNK = 256


@dataclass(slots=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    def to_dict(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}


@dataclass(slots=True)
class ChoiceState:
    """One choice's output so far (non-streaming) and its text offset (streaming logprobs)."""

    output: CompletionOutput = field(default_factory=lambda: CompletionOutput(0, "", [], None, None))
    text_offset: int = 0
    sent_role: bool = False
    started: bool = False  # its first output came (echo prefixes the prompt to it)
    tools: Any = None  # chat with tools: the choice's ToolCallStream, made on its first delta
    reasoning: Any = None  # chat with a reasoning parser: the choice's ReasoningStream


class ResponseBuilder(ABC):
    """What completions and chat share; the subclasses say how a choice, a chunk and
    logprobs look in each API."""

    object_name: str        # of a whole response
    chunk_object_name: str  # of a stream chunk

    def __init__(self, *, request_id: str, model: str, tokenizer: Any,
                 want_logprobs: bool, include_usage: bool = False, tokens_as_ids: bool = False,
                 n: int = 1, want_prompt_logprobs: bool = False) -> None:
        self.id = request_id
        self.model = model
        self.created = int(time.time())
        self.want_logprobs = want_logprobs
        self.include_usage = include_usage
        self.usage = Usage()
        self._tokenizer = tokenizer
        self._tokens_as_ids = tokens_as_ids  # vLLM's return_tokens_as_token_ids: "token_id:<id>"
        self._token_strs: dict[int, str] = {}
        self._choices: dict[int, ChoiceState] = {}
        self.n = n  # choices a prompt: choice index = prompt index x n + sequence index
        self.want_prompt_logprobs = want_prompt_logprobs  # vLLM's prompt_logprobs field
        self._prompt_logprobs: dict[int, list] = {}  # prompt index -> the engine's entries

    def record_prompt_logprobs(self, prompt_index: int, entries: list | None) -> None:
        """A request's prompt logprobs, from its first delta with output (before its chunks)."""
        if entries is not None:
            self._prompt_logprobs[prompt_index] = entries

    # ---- shared bookkeeping ------------------------------------------------------------

    def choice(self, index: int) -> ChoiceState:
        state = self._choices.get(index)
        if state is None:
            state = self._choices[index] = ChoiceState()
        return state

    def count_request(self, first_delta: RequestOutputDelta) -> None:
        """Prompt tokens count once per engine request, whatever its ``n``."""
        self.usage.prompt_tokens += first_delta.num_prompt_tokens
        self.usage.cached_tokens += first_delta.num_cached_tokens

    def count_sequence(self, seq: CompletionOutput) -> None:
        self.usage.completion_tokens += len(seq.token_ids)

    def token_str(self, token_id: int) -> str:
        s = self._token_strs.get(token_id)
        if s is None:
            s = f"token_id:{token_id}" if self._tokens_as_ids else self._tokenizer.decode([token_id])
            self._token_strs[token_id] = s
        return s

    # ---- whole responses ---------------------------------------------------------------

    def accumulate(self, index: int, seq: CompletionOutput) -> None:
        state = self.choice(index)
        if state.output.finish_reason is not None:
            return  # the engine repeats a finished sequence, empty, while its siblings run
        self.count_sequence(seq)
        if not state.started:
            state.started = True
            seq = self._first_output(index, seq)
        append_output(state.output, seq)

    def _first_output(self, index: int, seq: CompletionOutput) -> CompletionOutput:
        """A choice's first output as the response shows it (completions' echo puts the prompt first)."""
        return seq

    def vllm_prompt_logprobs(self, prompt_index: int) -> list | None:
        """vLLM's prompt_logprobs: per prompt token, None for the first, else its id's and the top
        ids' {"logprob", "rank", "decoded_token"}."""
        entries = self._prompt_logprobs.get(prompt_index)
        if entries is None:
            return None
        out: list = [None]
        for e in entries[1:]:
            ranked = {str(t): {"logprob": finite(lp), "rank": rank, "decoded_token": self.token_str(t)}
                      for rank, (t, lp) in enumerate(e.top, 1)}
            ranked.setdefault(str(e.token_id), {"logprob": finite(e.logprob), "rank": e.rank,
                                                "decoded_token": self.token_str(e.token_id)})
            out.append(ranked)
        return out

    def full_response(self) -> dict:
        choices = []
        for index in sorted(self._choices):
            out = self._choices[index].output
            logprobs = self._logprobs(out.logprobs or [], 0) if self.want_logprobs else None
            choices.append(self._with_prompt_logprobs(index, self._choice(index, out.text, logprobs,
                                                                          out.finish_reason, out.stop_reason)))
        return {"id": self.id, "object": self.object_name,
                "created": self.created, "model": self.model, "choices": choices,
                "usage": self.usage.to_dict(), **self._response_extras()}

    def _response_extras(self) -> dict:
        """Top-level fields of a whole response beyond OpenAI's (chat's prompt_logprobs)."""
        return {}

    def _with_prompt_logprobs(self, index: int, choice: dict) -> dict:
        if self.want_prompt_logprobs:
            choice["prompt_logprobs"] = self.vllm_prompt_logprobs(index // self.n)
        return choice

    def full_response_json(self) -> bytes:
        """``full_response()`` as its JSON body (each choice's ``logprobs`` written last), for a
        builder that is done: its outputs are released as they are written. Written
        ``LOGPROBS_CHUNK`` logprobs at a time, so that neither the objects alive at once (which the
        garbage collector walks, holding the GIL) nor one encoding or release grows with the
        response: a big body built on a thread leaves the event loop its turns."""
        head = {"id": self.id, "object": self.object_name, "created": self.created, "model": self.model}
        pieces = [_dumps(head)[:-1], ',"choices":[']
        for k, index in enumerate(sorted(self._choices)):
            out = self._choices.pop(index).output
            choice = self._with_prompt_logprobs(index, self._choice(index, out.text, None, out.finish_reason,
                                                                    out.stop_reason))
            pieces.append("," if k else "")
            if self.want_logprobs:
                del choice["logprobs"]
                pieces += [_dumps(choice)[:-1], ',"logprobs":', self._logprobs_json(out.logprobs or []), "}"]
            else:
                pieces.append(_dumps(choice))
        extras = "".join(f",{_dumps(key)}:{_dumps(value)}" for key, value in self._response_extras().items())
        pieces += ['],"usage":', _dumps(self.usage.to_dict()), extras, "}"]
        return "".join(pieces).encode()

    def _logprobs_json(self, entries: list[TokenLogprob]) -> str:
        """``_logprobs(entries, 0)`` as JSON text, made chunk by chunk; ``entries`` are released as
        they are written."""
        parts: dict[str, list[str]] = {key: [] for key in self._logprobs([], 0)}
        offset = 0
        for start in range(0, len(entries), LOGPROBS_CHUNK):
            chunk = entries[start:start + LOGPROBS_CHUNK]
            entries[start:start + len(chunk)] = [None] * len(chunk)
            for key, values in self._logprobs(chunk, offset).items():
                parts[key].append(_dumps(values)[1:-1])
            offset += sum(len(self.token_str(e.token_id)) for e in chunk)
        lists = (f'{_dumps(key)}:[{",".join(p for p in texts if p)}]' for key, texts in parts.items())
        return "{" + ",".join(lists) + "}"

    # ---- stream chunks -----------------------------------------------------------------

    def role_chunks(self, indices: list[int]) -> list[dict]:
        """The chunks that open a stream before any output (chat: the assistant role)."""
        return []

    def delta_chunk(self, index: int, seq: CompletionOutput) -> dict | None:
        """The chunk for one choice's new output in one engine step; None when it has nothing."""
        state = self.choice(index)
        if state.output.finish_reason is not None:
            return None  # the engine repeats a finished sequence, empty, while its siblings run
        self.count_sequence(seq)
        state.output.finish_reason = seq.finish_reason
        first = not state.started
        if first:
            state.started = True
            seq = self._first_output(index, seq)
        if not seq.text and not seq.token_ids and seq.finish_reason is None:
            return None
        logprobs = None
        if self.want_logprobs and seq.logprobs:
            logprobs = self._logprobs(seq.logprobs, state.text_offset)
        state.text_offset += len(seq.text)
        choice = self._delta_choice(index, seq, logprobs)
        if first and self.want_prompt_logprobs:
            choice["prompt_logprobs"] = self.vllm_prompt_logprobs(index // self.n)
        return self._chunk(choice)

    def usage_chunk(self) -> dict:
        chunk = self._chunk(None)
        chunk["usage"] = self.usage.to_dict()
        return chunk

    def _chunk(self, choice: dict | None) -> dict:
        chunk = {"id": self.id, "object": self.chunk_object_name,
                 "created": self.created, "model": self.model, "choices": [] if choice is None else [choice]}
        if self.include_usage:
            chunk["usage"] = None
        return chunk

    # ---- what differs between the two APIs ----------------------------------------------

    @abstractmethod
    def _choice(self, index: int, text: str, logprobs: dict | None, finish_reason: str | None,
                stop_reason: str | int | None) -> dict:
        """One choice of a whole response."""

    @abstractmethod
    def _delta_choice(self, index: int, seq: CompletionOutput, logprobs: dict | None) -> dict:
        """One choice of a stream chunk."""

    @abstractmethod
    def _logprobs(self, entries: list[TokenLogprob], start_offset: int) -> dict:
        """Logprobs of these entries in this API's format (completions count text offsets)."""


class CompletionResponseBuilder(ResponseBuilder):
    object_name = chunk_object_name = "text_completion"

    def __init__(self, *, echo_prompts: list[tuple[str, list[int]]] | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.echo_prompts = echo_prompts  # echo: each prompt's text and token ids, put before its output

    def _first_output(self, index: int, seq: CompletionOutput) -> CompletionOutput:
        if self.echo_prompts is None:
            return seq
        prompt_index = index // self.n
        text, ids = self.echo_prompts[prompt_index]
        logprobs = seq.logprobs
        if self.want_logprobs:
            scored = self._prompt_logprobs.get(prompt_index) or [None] * len(ids)
            prompt = [TokenLogprob(ids[0], None, [])] + [e for e in scored[1:] if e is not None]
            logprobs = prompt + list(seq.logprobs or [])
        return CompletionOutput(seq.index, text + seq.text, seq.token_ids, logprobs, seq.finish_reason,
                                seq.stop_reason)

    def _choice(self, index, text, logprobs, finish_reason, stop_reason) -> dict:
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason,
                "stop_reason": stop_reason}

    def _delta_choice(self, index, seq, logprobs) -> dict:
        return self._choice(index, seq.text, logprobs, seq.finish_reason, seq.stop_reason)

    def _logprobs(self, entries: list[TokenLogprob], start_offset: int) -> dict:
        """The legacy completions format: parallel lists plus per-token top dicts."""
        tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
        offset = start_offset
        for e in entries:
            s = self.token_str(e.token_id)
            tokens.append(s)
            if e.logprob is None:  # an echoed prompt's first token: nothing precedes it
                token_logprobs.append(None)
                top_logprobs.append(None)
            else:
                token_logprobs.append(finite(e.logprob))
                top = {self.token_str(t): finite(lp) for t, lp in e.top}
                top.setdefault(s, finite(e.logprob))
                top_logprobs.append(top)
            offsets.append(offset)
            offset += len(s)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
                "text_offset": offsets}


class ChatResponseBuilder(ResponseBuilder):
    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"

    def __init__(self, *, tool_plan: Any = None, reasoning: ReasoningParser | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        # tool_choice.ToolPlan, or None: the output is plain content
        self.tool_plan = tool_plan if tool_plan is not None and tool_plan.mode != "none" else None
        self.reasoning = reasoning  # --reasoning-parser: reasoning_content apart from content

    def _with_prompt_logprobs(self, index: int, choice: dict) -> dict:
        return choice  # chat's are the response's (vLLM's place), not a choice's

    def _response_extras(self) -> dict:
        return {"prompt_logprobs": self.vllm_prompt_logprobs(0)} if self.want_prompt_logprobs else {}

    def role_chunks(self, indices: list[int]) -> list[dict]:
        """Chat streams open each choice with the assistant role, as OpenAI does."""
        out = []
        for index in indices:
            state = self.choice(index)
            if not state.sent_role:
                state.sent_role = True
                out.append(self._chunk({"index": index, "delta": {"role": "assistant", "content": ""},
                                        "logprobs": None, "finish_reason": None}))
        return out

    def _choice(self, index, text, logprobs, finish_reason, stop_reason) -> dict:
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if self.reasoning is not None:
            split = self.reasoning.split(text)
            message["reasoning_content"], message["content"] = split
            text = split.content or ""
        if self.tool_plan is not None:
            extracted = self.tool_plan.extract(text)
            message["content"] = extracted.content
            message["tool_calls"] = [tool_call_dict(call) for call in extracted.tool_calls]
            finish_reason = _with_tool_calls(finish_reason, extracted.tool_calls)
        return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason,
                "stop_reason": stop_reason}

    def _delta_choice(self, index, seq, logprobs) -> dict:
        finish_reason = seq.finish_reason
        text, reasoning = seq.text, ""
        if self.reasoning is not None:
            state = self.choice(index)
            if state.reasoning is None:
                state.reasoning = self.reasoning.stream()
            reasoning, text = state.reasoning.feed(seq.text)
            if finish_reason is not None:
                last = state.reasoning.finish()
                reasoning, text = reasoning + last.reasoning, text + last.content
        if self.tool_plan is None:
            delta = {"content": text} if text or (finish_reason is None and not reasoning) else {}
        else:
            state = self.choice(index)
            if state.tools is None:
                state.tools = self.tool_plan.stream()
            content, calls = state.tools.feed(text)
            if finish_reason is not None:
                more = state.tools.finish()
                content, calls = content + more.content, calls + more.tool_calls
                finish_reason = _with_tool_calls(finish_reason, state.tools.tool_calls)
            delta = {"content": content} if content else {}
            if calls:
                delta["tool_calls"] = [tool_call_delta_dict(d) for d in calls]
        if reasoning:
            delta = {"reasoning_content": reasoning, **delta}
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        if finish_reason is not None:
            choice["stop_reason"] = seq.stop_reason
        return choice

    def _logprobs(self, entries: list[TokenLogprob], start_offset: int) -> dict:
        content = []
        for e in entries:
            s = self.token_str(e.token_id)
            top = [{"token": self.token_str(t), "logprob": finite(lp), "bytes": list(self.token_str(t).encode())}
                   for t, lp in e.top]
            content.append({"token": s, "logprob": finite(e.logprob), "bytes": list(s.encode()), "top_logprobs": top})
        return {"content": content}


def _with_tool_calls(finish_reason: str | None, calls: list) -> str | None:
    """A choice that ended by itself (not cut off by max_tokens) with calls ends in "tool_calls"."""
    return "tool_calls" if calls and finish_reason == "stop" else finish_reason


def tool_call_dict(call: Any) -> dict:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def tool_call_delta_dict(delta: Any) -> dict:
    """OpenAI's streamed tool call entry: id, type and name on a call's first entry only."""
    out: dict[str, Any] = {"index": delta.index}
    if delta.id is not None:
        out["id"], out["type"] = delta.id, "function"
    out["function"] = {"arguments": delta.arguments} if delta.name is None else \
        {"name": delta.name, "arguments": delta.arguments}
    return out


def json_body(content: Any) -> bytes:
    """A response body as JSON, written as Starlette's ``JSONResponse`` writes it."""
    return _dumps(content).encode()


def _dumps(content: Any) -> str:
    return json.dumps(content, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":"))


def finite(logprob: float) -> float:
    """JSON has no -Infinity: a token with zero probability reports -9999.0, as vLLM does."""
    return max(float(logprob), -9999.0)
