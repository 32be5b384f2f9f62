"""Tool-call parsers on the families' documented outputs: what ``extract`` finds, and that the same
text streamed in any pieces (every two-piece split, one character at a time, random splits)
gives the same content and the same calls, argument text included."""

from __future__ import annotations

import itertools
import random
import re

import pytest

from pagefleet.router.openai.tool_parsers import TOOL_PARSERS, ToolCall, get_tool_parser

CALL_ID = re.compile(r"call_[A-Za-z0-9]{24}")


def pieces_of(text: str, seed: int = 0):
    """Every way to cut the text in two, one character at a time, and random cuts."""
    for cut in range(len(text) + 1):
        yield [text[:cut], text[cut:]]
    yield list(text)
    rng = random.Random(seed)
    for _ in range(25):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12)))) if len(text) > 1 else []
        bounds = [0, *cuts, len(text)]
        yield [text[a:b] for a, b in itertools.pairwise(bounds)]


def stream_pieces(parser, pieces: list[str]) -> tuple[str, list[ToolCall]]:
    """Content and calls as a client assembles them from the deltas, checking the deltas' shape."""
    stream = parser.stream()
    content = []
    calls: list[list[str]] = []  # [id, name, arguments] by index
    for delta in [stream.feed(p) for p in pieces] + [stream.finish()]:
        content.append(delta.content)
        for d in delta.tool_calls:
            if d.index == len(calls):  # a call's first delta carries its id and name
                assert CALL_ID.fullmatch(d.id) and d.name
                calls.append([d.id, d.name, d.arguments])
            else:
                assert d.index < len(calls) and d.id is None and d.name is None and d.arguments
                calls[d.index][2] += d.arguments
    assembled = [ToolCall(*c) for c in calls]
    assert stream.tool_calls == assembled
    return "".join(content), assembled


def names_and_arguments(calls: list[ToolCall]) -> list[tuple[str, str]]:
    return [(c.name, c.arguments) for c in calls]


def check(parser_name: str, text: str, content: str | None, calls: list[tuple[str, str]]) -> None:
    parser = get_tool_parser(parser_name)
    extracted = parser.extract(text)
    assert extracted.content == content
    assert names_and_arguments(extracted.tool_calls) == calls
    assert all(CALL_ID.fullmatch(c.id) for c in extracted.tool_calls)
    assert len({c.id for c in extracted.tool_calls}) == len(calls)
    for pieces in pieces_of(text):
        streamed_content, streamed_calls = stream_pieces(parser, pieces)
        assert (streamed_content, names_and_arguments(streamed_calls)) == (content or "", calls), pieces


# Qwen2.5's function-calling guide (qwen.readthedocs.io, framework/function_call): the model's
# reply to "What's the temperature in San Francisco now? How about tomorrow?".
QWEN_PARALLEL = (
    '<tool_call>\n{"name": "get_current_temperature", "arguments": {"location": "San Francisco, CA, USA"}}\n'
    '</tool_call>\n<tool_call>\n{"name": "get_temperature_date", "arguments": {"location": "San Francisco, CA, USA", '
    '"date": "2024-10-01"}}\n</tool_call>'
)
NESTED_ARGUMENTS = ('{"event": {"title": "Standup", "attendees": [{"email": "a@x.io"}, {"email": "b@x.io"}], '
                    '"time": {"start": "09:00", "zone": null}, "repeat": [1, 2.5, true]}}')
UNICODE_ARGUMENTS = '{"query": "café \\"Les Deux Magots\\" 東京 🙂", "path": "C:\\\\tmp\\\\a}b", "note": "\\u00e9 ]"}'


HERMES_CASES = {
    "single": (('<tool_call>\n{"name": "get_current_temperature", "arguments": {"location": "San Francisco, CA, USA"}}'
                '\n</tool_call>'),
               None, [("get_current_temperature", '{"location": "San Francisco, CA, USA"}')]),
    "parallel": (QWEN_PARALLEL, None, [
        ("get_current_temperature", '{"location": "San Francisco, CA, USA"}'),
        ("get_temperature_date", '{"location": "San Francisco, CA, USA", "date": "2024-10-01"}')]),
    "content before": ("I'll check both days.\n\n" + QWEN_PARALLEL + "\n", "I'll check both days.", [
        ("get_current_temperature", '{"location": "San Francisco, CA, USA"}'),
        ("get_temperature_date", '{"location": "San Francisco, CA, USA", "date": "2024-10-01"}')]),
    "content after": ('<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>\nDone.', "\nDone.", [("f", "{}")]),
    "unicode and escapes": (f'<tool_call>\n{{"name": "search", "arguments": {UNICODE_ARGUMENTS}}}\n</tool_call>',
                            None, [("search", UNICODE_ARGUMENTS)]),
    "nested": (f'<tool_call>\n{{"name": "create_event", "arguments": {NESTED_ARGUMENTS}}}\n</tool_call>',
               None, [("create_event", NESTED_ARGUMENTS)]),
    # Hermes 2 Pro's system prompt asks for {"arguments": <args-dict>, "name": <function-name>}.
    "arguments first": (('<tool_call>\n{"arguments": {"symbol": "TSLA"}, "name": "get_stock_fundamentals"}'
                         '\n</tool_call>'),
                        None, [("get_stock_fundamentals", '{"symbol": "TSLA"}')]),
    "no arguments": ('<tool_call>\n{"name": "get_time"}\n</tool_call>', None, [("get_time", "{}")]),
    "arguments as a string": ('<tool_call>\n{"name": "f", "arguments": "{\\"a\\": 1}"}\n</tool_call>',
                              None, [("f", '{"a": 1}')]),
    "not json": ("<tool_call>\nget_weather(city='Paris')\n</tool_call>",
                 "<tool_call>\nget_weather(city='Paris')\n</tool_call>", []),
    "no name": ('Hm. <tool_call>\n{"arguments": {"city": "Paris"}}\n</tool_call> ok',
                'Hm. <tool_call>\n{"arguments": {"city": "Paris"}}\n</tool_call> ok', []),
    "name not a string": ('<tool_call>{"name": 7, "arguments": {}}</tool_call>',
                          '<tool_call>{"name": 7, "arguments": {}}</tool_call>', []),
    "unquoted key": ('<tool_call>{name: "f"}</tool_call>', '<tool_call>{name: "f"}</tool_call>', []),
    "malformed, then a call": ('<tool_call>oops</tool_call><tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>',
                               "<tool_call>oops</tool_call>", [("f", '{"x": 1}')]),
    "end tag before the header": ('<tool_call>{"name": "f"</tool_call>', '<tool_call>{"name": "f"</tool_call>', []),
    "cut off in the header": ('Sure <tool_call>\n{"name": "get_w', 'Sure <tool_call>\n{"name": "get_w', []),
    "cut off in the arguments": ('<tool_call>\n{"name": "f", "arguments": {"text": "half', None,
                                 [("f", '{"text": "half')]),
    "end tag inside the arguments": ('<tool_call>{"name": "f", "arguments": {"a": "x</tool_call>y',
                                     "y", [("f", '{"a": "x')]),
    "a tag-like text": ("a < b, <tool> and <tool_call", "a < b, <tool> and <tool_call", []),
    "plain text": ("The answer is 42.\n", "The answer is 42.\n", []),
}


@pytest.mark.parametrize("case", HERMES_CASES, ids=str)
def test_hermes(case):
    check("hermes", *HERMES_CASES[case])


# Meta's Llama 3.1 prompt format (JSON-based tool calling) and Llama 3.2's parallel form.
LLAMA_CASES = {
    "single": (('{"name": "get_current_conditions", "parameters": {"location": "San Francisco, CA", '
                '"unit": "Fahrenheit"}}'),
               None, [("get_current_conditions", '{"location": "San Francisco, CA", "unit": "Fahrenheit"}')]),
    "python tag": ('<|python_tag|>{"name": "get_current_conditions", "parameters": {"location": "Menlo Park, CA"}}',
                   None, [("get_current_conditions", '{"location": "Menlo Park, CA"}')]),
    "parallel": (('{"name": "get_weather", "parameters": {"city": "Paris"}}; '
                  '{"name": "get_time", "parameters": {"zone": "CET"}}'),
                 None, [("get_weather", '{"city": "Paris"}'), ("get_time", '{"zone": "CET"}')]),
    "type field": ('{"type": "function", "name": "get_weather", "parameters": {"city": "Oslo"}}',
                   None, [("get_weather", '{"city": "Oslo"}')]),
    "arguments key": ('{"name": "f", "arguments": {"a": 1}}', None, [("f", '{"a": 1}')]),
    "unicode and escapes": (f'{{"name": "search", "parameters": {UNICODE_ARGUMENTS}}}',
                            None, [("search", UNICODE_ARGUMENTS)]),
    "nested": (f'{{"name": "create_event", "parameters": {NESTED_ARGUMENTS}}}', None,
               [("create_event", NESTED_ARGUMENTS)]),
    "plain text": ("It is sunny in Paris today.", "It is sunny in Paris today.", []),
    "plain json": ('{"result": 42, "unit": "C"}', '{"result": 42, "unit": "C"}', []),
    "malformed": ('{"name": "get_weather", "parameters": }', '{"name": "get_weather", "parameters": }', []),
    "text after the calls": ('{"name": "f", "parameters": {}}\nThat is all.', "That is all.", [("f", "{}")]),
    "cut off": ('{"name": "f", "parameters": {"city": "Par', None, [("f", '{"city": "Par')]),
    "cut off in the header": ('<|python_tag|>{"name": "f", "param', '<|python_tag|>{"name": "f", "param', []),
}


@pytest.mark.parametrize("case", LLAMA_CASES, ids=str)
def test_llama3_json(case):
    check("llama3_json", *LLAMA_CASES[case])


# mistral-common's tokenizers: V3 (Mistral-7B-Instruct-v0.3) writes the calls as one JSON list
# (mistralai/cookbook, concept-deep-dive/tokenization/tool_calling.md, the "Assistant Tool Call" of
# its V3 scenario); V11 and later write [TOOL_CALLS]name[ARGS]{...} per call, V11 with [CALL_ID]id
# before [ARGS].
MISTRAL_CASES = {
    "cookbook v3": (('[TOOL_CALLS] [{"name": "calculator", "arguments": {"operation": "2+2", "format": "celsius"}, '
                     '"id": "VvvODy9mT"}]'),
                    None, [("calculator", '{"operation": "2+2", "format": "celsius"}')]),
    "list": (('[TOOL_CALLS] [{"name": "get_current_weather", "arguments": {"location": "Paris, France", '
              '"format": "celsius"}}]'),
             None, [("get_current_weather", '{"location": "Paris, France", "format": "celsius"}')]),
    "list, parallel, ids": (('[TOOL_CALLS] [{"name": "a", "arguments": {"x": 1}, "id": "abc123def"}, '
                             '{"name": "b", "arguments": {"y": [2]}, "id": "bcd234efa"}]'),
                            None, [("a", '{"x": 1}'), ("b", '{"y": [2]}')]),
    "named": ('[TOOL_CALLS]get_current_weather[ARGS]{"location": "Paris, France", "format": "celsius"}',
              None, [("get_current_weather", '{"location": "Paris, France", "format": "celsius"}')]),
    "named, parallel, call id": (('[TOOL_CALLS]get_weather[CALL_ID]abc123def[ARGS]{"city": "Paris"}'
                                  '[TOOL_CALLS]get_time[ARGS]{}'),
                                 None, [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")]),
    "content before": ('Let me check.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}', "Let me check.",
                       [("get_weather", '{"city": "Paris"}')]),
    "unicode and escapes": (f"[TOOL_CALLS]search[ARGS]{UNICODE_ARGUMENTS}", None, [("search", UNICODE_ARGUMENTS)]),
    "nested": (f'[TOOL_CALLS] [{{"name": "create_event", "arguments": {NESTED_ARGUMENTS}}}]', None,
               [("create_event", NESTED_ARGUMENTS)]),
    "not a list of calls": ('x [TOOL_CALLS] [{"nam": 1}] y', 'x [TOOL_CALLS] [{"nam": 1}] y', []),
    "bad name": ("[TOOL_CALLS]get weather[ARGS]{}", "[TOOL_CALLS]get weather[ARGS]{}", []),
    "no arguments object": ('[TOOL_CALLS]f[ARGS]"x"', '[TOOL_CALLS]f[ARGS]"x"', []),
    "a lone tag": ("[TOOL_CALLS]", "[TOOL_CALLS]", []),
    "text after the list": ('[TOOL_CALLS] [{"name": "f", "arguments": {}}] Done', " Done", [("f", "{}")]),
    "cut off": ('[TOOL_CALLS]f[ARGS]{"a": [1, 2', None, [("f", '{"a": [1, 2')]),
    "plain text": ("Paris is sunny [today].", "Paris is sunny [today].", []),
}


@pytest.mark.parametrize("case", MISTRAL_CASES, ids=str)
def test_mistral(case):
    check("mistral", *MISTRAL_CASES[case])


def test_a_possible_tag_is_held_back_until_it_is_not_one():
    stream = get_tool_parser("hermes").stream()
    assert stream.feed("Sure <tool_c").content == "Sure"
    assert stream.feed("ar").content == " <tool_car"
    stream = get_tool_parser("mistral").stream()
    assert stream.feed("Checking[TOOL_").content == "Checking"
    assert stream.finish().content == "[TOOL_"


def test_a_call_goes_out_when_its_arguments_begin_and_counts_once_they_close():
    stream = get_tool_parser("hermes").stream()
    first = stream.feed('<tool_call>\n{"name": "get_weather", "arguments": {"ci')
    assert first.content == "" and [(d.index, d.name, d.arguments) for d in first.tool_calls] == [
        (0, "get_weather", '{"ci')]
    assert stream.tool_calls == []  # not complete yet
    second = stream.feed('ty": "Paris"}}\n</tool_call>')
    assert [(d.index, d.id, d.arguments) for d in second.tool_calls] == [(0, None, 'ty": "Paris"}')]
    assert [(c.id, c.name, c.arguments) for c in stream.tool_calls] == [
        (first.tool_calls[0].id, "get_weather", '{"city": "Paris"}')]


def test_a_cut_off_call_counts_after_finish():
    stream = get_tool_parser("llama3_json").stream()
    stream.feed('{"name": "f", "parameters": {"a": 1')
    assert stream.tool_calls == []
    assert stream.finish() == ("", [])
    assert names_and_arguments(stream.tool_calls) == [("f", '{"a": 1')]


def test_registry_and_unknown_name():
    assert sorted(TOOL_PARSERS) == ["hermes", "llama3_json", "mistral"]
    assert all(get_tool_parser(name).name == name for name in TOOL_PARSERS)
    with pytest.raises(ValueError, match="unknown tool parser 'qwen'; choose one of hermes, llama3_json, mistral"):
        get_tool_parser("qwen")


# Pieces of the three formats, well and badly formed, to break the documented texts with.
FRAGMENTS = ["<tool_call>", "</tool_call>", "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]", "<|python_tag|>", "<tool_c",
             "[TOOL_", '{"name": "f", "arguments": ', '{"name": "g", "parameters": ', '{"a": [1, "}"]}', "{", "}",
             "[", "]", '"', "\\", ":", ",", ";", " ", "\n", "get_w", "é", "x"]
CASES = {"hermes": HERMES_CASES, "llama3_json": LLAMA_CASES, "mistral": MISTRAL_CASES}


def mutated(text: str, rng: random.Random) -> str:
    """The text with up to three random edits: a fragment put in, a few characters taken out, the end cut."""
    for _ in range(rng.randint(0, 3)):
        at = rng.randint(0, len(text))
        edit = rng.randrange(3)
        if edit == 0:
            text = text[:at] + rng.choice(FRAGMENTS) + text[at:]
        elif edit == 1:
            text = text[:at] + text[at + rng.randint(1, 5):]
        else:
            text = text[:at]
    return text


@pytest.mark.parametrize("parser_name", sorted(CASES))
def test_broken_texts_stream_as_they_extract(parser_name):
    parser = get_tool_parser(parser_name)
    rng = random.Random(parser_name)
    documented = [case[0] for case in CASES[parser_name].values()]
    found_calls = 0
    for _ in range(120):
        text = mutated(rng.choice(documented), rng)
        extracted = parser.extract(text)
        found_calls += len(extracted.tool_calls)
        want = (extracted.content or "", names_and_arguments(extracted.tool_calls))
        for pieces in [list(text), *([text[:cut], text[cut:]] for cut in range(0, len(text) + 1, 3))]:
            streamed_content, streamed_calls = stream_pieces(parser, pieces)
            assert (streamed_content, names_and_arguments(streamed_calls)) == want, pieces
    assert found_calls > 30  # the edits leave many calls whole or cut off, not only broken text


def test_feed_after_finish_is_refused():
    stream = get_tool_parser("hermes").stream()
    stream.finish()
    with pytest.raises(RuntimeError, match="feed after finish"):
        stream.feed("x")
