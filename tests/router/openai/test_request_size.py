"""What a request brings, measured before the work that grows with it (``request_size``), and the
non-streamed body written in pieces (``ResponseBuilder.full_response_json``)."""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from pagefleet.router.openai.errors import OpenAIError
from pagefleet.router.openai.output.responses import (
    LOGPROBS_CHUNK,
    ChatResponseBuilder,
    CompletionResponseBuilder,
)
from pagefleet.router.openai.protocol import ChatCompletionRequest
from pagefleet.router.openai.request_size import (
    ITEM_CHARS,
    chat_work,
    check_unstreamed_size,
    json_chars,
    message_chars,
    tool_chars,
)
from pagefleet.worker.outputs import CompletionOutput, TokenLogprob
from pagefleet.worker.sampling_params import SamplingParams


def test_json_chars_counts_strings_keys_and_values_and_stops_past_its_bound():
    value = {"ab": ["cde", 1, None, {"f": "gh"}]}
    # values: the dict, the list, "cde", 1, None, the inner dict, "gh" (7); keys ab, f (3); strings cde, gh (5)
    assert json_chars(value) == 7 + 3 + 5
    assert json_chars(value) <= len(json.dumps(value, separators=(",", ":")))
    wide = list(range(10**6))
    assert 100 < json_chars(wide, stop_after=100) <= 102  # stops at once, not after a million
    assert json_chars({str(i): i for i in range(10**6)}, stop_after=50) <= 60


def _req(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], **fields})


def test_chat_work_counts_content_parts_calls_and_tools():
    parts = [{"type": "text", "text": "x" * 100}] * 30
    req = _req(messages=[{"role": "user", "content": parts},
                         {"role": "assistant", "content": None, "tool_calls": [
                             {"id": "c1", "function": {"name": "f", "arguments": {"q": "y" * 50}}}]}],
               tools=[{"type": "function", "function": {"name": "get", "description": "d" * 10,
                                                        "parameters": {"type": "object"}}}])
    assert message_chars(req.messages[0]) == 30 * 101
    assert message_chars(req.messages[1]) == 1 + json_chars({"q": "y" * 50})
    assert tool_chars(req.tools[0]) == 3 + 10 + json_chars({"type": "object"})
    total = 3 * ITEM_CHARS + message_chars(req.messages[0]) + message_chars(req.messages[1]) + tool_chars(req.tools[0])
    assert chat_work(req.messages, req.tools, stop_after=10**6) == total
    assert chat_work(req.messages, req.tools, stop_after=500) < 30 * 101  # stopped in the first message


def test_the_unstreamed_bound_names_the_fields_and_the_flag():
    params = [SamplingParams(n=4, max_tokens=100, logprobs=4)]
    check_unstreamed_size(params, 4 * 100 * 5, {})
    with pytest.raises(OpenAIError) as refused:
        check_unstreamed_size(params, 4 * 100 * 5 - 1,
                              {"logprobs": "top_logprobs", "max_tokens": "max_completion_tokens"})
    error = refused.value
    assert (error.status_code, error.param) == (400, "max_completion_tokens")
    assert "n=4 x max_completion_tokens=100 x (1 + top_logprobs=4) holds up to 2000" in str(error.message)
    assert "at most 1999 in one body (max_unstreamed_response_tokens)" in str(error.message)
    with pytest.raises(OpenAIError, match="3 prompts x n=1 x max_tokens=10 x \\(1 \\+ logprobs=0\\) holds up to 30"):
        check_unstreamed_size([SamplingParams(max_tokens=10)] * 3, 29, {})


def _tokenizer() -> PreTrainedTokenizerFast:
    vocab = {chr(c): c - 97 for c in range(97, 123)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="a"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    return PreTrainedTokenizerFast(tokenizer_object=tok)


@pytest.mark.parametrize("builder_class", [ChatResponseBuilder, CompletionResponseBuilder])
@pytest.mark.parametrize("want_logprobs", [True, False])
def test_the_body_written_in_pieces_is_the_whole_response(builder_class, want_logprobs):
    def built():
        builder = builder_class(request_id="r", model="m", tokenizer=_tokenizer(), want_logprobs=want_logprobs)
        for index, length in enumerate([LOGPROBS_CHUNK * 2 + 7, 0, 3]):
            ids = [(index + i) % 26 for i in range(length)]
            logprobs = [TokenLogprob(t, -0.25 * (t % 4), [(t, -0.5), ((t + 1) % 26, float("-inf"))]) for t in ids]
            text = "".join(chr(97 + t) for t in ids)
            for start in range(0, max(length, 1), 100):  # several deltas
                end = min(start + 100, length)
                builder.accumulate(index, CompletionOutput(index, text[start:end], ids[start:end],
                                                           logprobs[start:end] if want_logprobs else None,
                                                           "length" if end == length else None))
        return builder

    whole = built().full_response()
    assert json.loads(built().full_response_json()) == whole
    if want_logprobs and builder_class is CompletionResponseBuilder:  # offsets run on across chunks
        offsets = whole["choices"][0]["logprobs"]["text_offset"]
        assert offsets == list(range(LOGPROBS_CHUNK * 2 + 7))
