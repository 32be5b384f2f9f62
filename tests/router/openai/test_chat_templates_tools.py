"""Chat templates with tools: the demo model's (Qwen2.5's tool format), three families' published
templates (tests/data/chat_templates), and the ingress's message handling that feeds them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pagefleet.router.openai.chat_template import NoToolSupportError, render_chat, template_reads_tools
from pagefleet.router.openai.errors import OpenAIError
from pagefleet.router.openai.preprocess import ModelInfo, chat_conversation, chat_prompt
from pagefleet.router.openai.protocol import ChatCompletionRequest
from pagefleet.router.openai.tool_parsers import get_tool_parser
from pagefleet.worker.request_check import RequestLimits
from pagefleet.worker.simulated.tokenizer import build_demo_tokenizer

TEMPLATES = Path(__file__).resolve().parents[2] / "data" / "chat_templates"
INFO = ModelInfo(served_model_name="demo", limits=RequestLimits(vocab_size=1000, max_model_len=2048, max_num_seqs=8))

# Qwen2.5's function-calling guide's tools, trimmed to one.
TOOLS = [{"type": "function", "function": {
    "name": "get_current_temperature",
    "description": "Get current temperature at a location.",
    "parameters": {"type": "object", "properties": {"location": {
        "type": "string",
        "description": 'The location to get the temperature for, in the format "City, State, Country".'}},
        "required": ["location"]}}}]
TOOL_JSON = json.dumps(TOOLS[0], ensure_ascii=False)  # what Transformers' tojson writes
ARGUMENTS = '{"location": "San Francisco, CA, USA"}'
CALL_ID = "abc123def"
# The request's messages, as a client sends them: the call's arguments as JSON text, no content.
MESSAGES = [
    {"role": "system", "content": "You are a weather bot."},
    {"role": "user", "content": "What's the temperature in San Francisco now?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": CALL_ID, "type": "function", "function": {"name": "get_current_temperature", "arguments": ARGUMENTS}}]},
    {"role": "tool", "tool_call_id": CALL_ID, "content": '{"temperature": 26.1}'},
]


def tokenizer_with(template_file: str | None = None):
    tokenizer = build_demo_tokenizer(1000, 2048)
    if template_file is not None:
        tokenizer.chat_template = (TEMPLATES / template_file).read_text()
    return tokenizer


def conversation(messages=MESSAGES) -> list[dict]:
    request = ChatCompletionRequest.model_validate({"messages": messages})
    return chat_conversation(request.messages, INFO, add_generation_prompt=True)


def test_messages_with_tool_calls_and_tool_results_become_template_input():
    assert conversation()[2:] == [
        {"role": "assistant", "content": "", "tool_calls": [{"id": CALL_ID, "type": "function", "function": {
            "name": "get_current_temperature", "arguments": {"location": "San Francisco, CA, USA"}}}]},
        {"role": "tool", "content": '{"temperature": 26.1}', "tool_call_id": CALL_ID},
    ]
    # Arguments that are not a JSON object stay text; tool fields on other roles are not passed on.
    odd = conversation([
        {"role": "user", "content": "hi", "tool_call_id": "x", "tool_calls": [
            {"id": "1", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "assistant", "content": "Sure.", "tool_calls": [
            {"id": "2", "function": {"name": "f", "arguments": "[1, 2"}},
            {"id": "3", "function": {"name": "g", "arguments": {"a": 1}}}]},
    ])
    assert odd == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure.", "tool_calls": [
        {"id": "2", "type": "function", "function": {"name": "f", "arguments": "[1, 2"}},
        {"id": "3", "type": "function", "function": {"name": "g", "arguments": {"a": 1}}}]}]


def test_demo_template_renders_tools_calls_and_results_as_qwen25_does():
    demo = render_chat(tokenizer_with(), conversation(), tools=TOOLS)
    assert demo == (
        "<|im_start|>system\nYou are a weather bot.\n\n# Tools\n\n"
        "You may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
        f"{TOOL_JSON}\n</tools>\n\n"
        "For each function call, return a json object with function name and arguments within "
        '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n'
        "</tool_call><|im_end|>\n"
        "<|im_start|>user\nWhat's the temperature in San Francisco now?<|im_end|>\n"
        f'<|im_start|>assistant\n<tool_call>\n{{"name": "get_current_temperature", "arguments": {ARGUMENTS}}}\n'
        "</tool_call><|im_end|>\n"
        '<|im_start|>user\n<tool_response>\n{"temperature": 26.1}\n</tool_response><|im_end|>\n'
        "<|im_start|>assistant\n")
    assert demo == render_chat(tokenizer_with("qwen2.5_instruct.jinja"), conversation(), tools=TOOLS)


def test_demo_template_without_tools_is_plain_chatml_and_its_calls_parse_back():
    tokenizer = tokenizer_with()
    assert render_chat(tokenizer, conversation(MESSAGES[:2])) == (
        "<|im_start|>system\nYou are a weather bot.<|im_end|>\n"
        "<|im_start|>user\nWhat's the temperature in San Francisco now?<|im_end|>\n<|im_start|>assistant\n")
    # Two calls after some text, then two results in one user turn: the assistant turn is what
    # the hermes parser reads back into the same calls.
    calls = [{"id": "c1", "type": "function", "function": {"name": "get_current_temperature", "arguments": ARGUMENTS}},
             {"id": "c2", "type": "function", "function": {"name": "get_current_temperature",
                                                           "arguments": '{"location": "Zürich, ZH, CH"}'}}]
    messages = [MESSAGES[1], {"role": "assistant", "content": "Checking both.", "tool_calls": calls},
                {"role": "tool", "tool_call_id": "c1", "content": "26.1"},
                {"role": "tool", "tool_call_id": "c2", "content": "18.0"}]
    text = render_chat(tokenizer, conversation(messages), tools=TOOLS)
    turn = text.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    extracted = get_tool_parser("hermes").extract(turn)
    assert extracted.content == "Checking both."
    assert [(c.name, c.arguments) for c in extracted.tool_calls] == [
        ("get_current_temperature", ARGUMENTS), ("get_current_temperature", '{"location": "Zürich, ZH, CH"}')]
    assert text.endswith("<|im_start|>user\n<tool_response>\n26.1\n</tool_response>\n<tool_response>\n18.0\n"
                         "</tool_response><|im_end|>\n<|im_start|>assistant\n")


def test_qwen25_template():
    tokenizer = tokenizer_with("qwen2.5_instruct.jinja")
    text = render_chat(tokenizer, conversation(MESSAGES[1:]), tools=TOOLS)
    # Without a system message, Qwen's default one opens the tools block.
    assert text.startswith("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant."
                           "\n\n# Tools\n\n")
    assert f"<tools>\n{TOOL_JSON}\n</tools>" in text
    assert (f'<|im_start|>assistant\n<tool_call>\n{{"name": "get_current_temperature", "arguments": {ARGUMENTS}}}\n'
            "</tool_call><|im_end|>\n") in text
    assert '<|im_start|>user\n<tool_response>\n{"temperature": 26.1}\n</tool_response><|im_end|>\n' in text


def test_llama31_template():
    tokenizer = tokenizer_with("llama3.1_instruct.jinja")
    text = render_chat(tokenizer, conversation(), tools=TOOLS)
    assert text.startswith("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython\n"
                           "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n"
                           "You are a weather bot.<|eot_id|>")
    # The tools go into the first user turn, as 4-space indented JSON.
    assert ("<|start_header_id|>user<|end_header_id|>\n\nGiven the following functions, please respond with a JSON "
            "for a function call with its proper arguments that best answers the given prompt.\n\n"
            'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.'
            f"Do not use variables.\n\n{json.dumps(TOOLS[0], indent=4, ensure_ascii=False)}\n\n"
            "What's the temperature in San Francisco now?<|eot_id|>") in text
    call = f'{{"name": "get_current_temperature", "parameters": {ARGUMENTS}}}'
    assert f"<|start_header_id|>assistant<|end_header_id|>\n\n{call}<|eot_id|>" in text
    # A tool result goes into an ipython turn, as a JSON string.
    assert '<|start_header_id|>ipython<|end_header_id|>\n\n"{\\"temperature\\": 26.1}"<|eot_id|>' in text
    assert [(c.name, c.arguments) for c in get_tool_parser("llama3_json").extract(call).tool_calls] == [
        ("get_current_temperature", ARGUMENTS)]


def test_mistral_v03_template():
    tokenizer = tokenizer_with("mistral_v0.3_instruct.jinja")
    text = render_chat(tokenizer, conversation(MESSAGES[1:]), tools=TOOLS)
    function = TOOLS[0]["function"]
    parameters = json.dumps(function["parameters"], ensure_ascii=False)
    assert text == (
        f'{tokenizer.bos_token} [AVAILABLE_TOOLS] [{{"type": "function", "function": {{"name": "{function["name"]}", '
        f'"description": "{function["description"]}", "parameters": {parameters}}}}}] [/AVAILABLE_TOOLS]'
        " [INST] What's the temperature in San Francisco now? [/INST]"
        f' [TOOL_CALLS] [{{"name": "get_current_temperature", "arguments": {ARGUMENTS}, "id": "{CALL_ID}"}}] '
        f"{tokenizer.eos_token}"
        f' [TOOL_RESULTS] {{"call_id": "{CALL_ID}", "content": {{"temperature": 26.1}}}} [/TOOL_RESULTS] ')
    calls_text = text[text.index("[TOOL_CALLS]"):text.index(tokenizer.eos_token, 1)]
    assert [(c.name, c.arguments) for c in get_tool_parser("mistral").extract(calls_text).tool_calls] == [
        ("get_current_temperature", ARGUMENTS)]


@pytest.mark.parametrize("template_file", [None, "qwen2.5_instruct.jinja", "llama3.1_instruct.jinja",
                                           "mistral_v0.3_instruct.jinja"])
def test_every_template_here_reads_tools(template_file):
    assert template_reads_tools(tokenizer_with(template_file))


def test_tools_for_a_template_without_them_are_refused():
    tokenizer = tokenizer_with()
    tokenizer.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    assert not template_reads_tools(tokenizer)
    with pytest.raises(NoToolSupportError, match="^this model's chat template has no tool support$"):
        render_chat(tokenizer, conversation(MESSAGES[:2]), tools=TOOLS)
    # No tools, or an empty list of them, renders as before.
    assert render_chat(tokenizer, conversation(MESSAGES[:2]), tools=[]) == (
        "system: You are a weather bot.\nuser: What's the temperature in San Francisco now?\n")
    with pytest.raises(OpenAIError) as refused:
        chat_prompt(conversation(MESSAGES[:2]), tokenizer, add_generation_prompt=True, tools=TOOLS)
    assert (refused.value.status_code, refused.value.param, refused.value.message) == (
        400, "tools", "this model's chat template has no tool support")


def test_a_template_dict_uses_its_tool_use_template_for_tools():
    tokenizer = tokenizer_with()
    tool_use = (TEMPLATES / "qwen2.5_instruct.jinja").read_text()
    tokenizer.chat_template = {"default": "{{ messages[0]['content'] }}", "tool_use": tool_use}
    assert template_reads_tools(tokenizer)
    assert f"<tools>\n{TOOL_JSON}\n</tools>" in render_chat(tokenizer, conversation(MESSAGES[:2]), tools=TOOLS)
    assert render_chat(tokenizer, conversation(MESSAGES[:2])) == "You are a weather bot."


def test_chat_prompt_passes_tools_and_counts_call_arguments_as_prompt_characters():
    tokenizer = tokenizer_with()
    prompt = chat_prompt(conversation(), tokenizer, add_generation_prompt=True, tools=TOOLS)
    assert prompt.text == render_chat(tokenizer, conversation(), tools=TOOLS)
    assert prompt.token_ids == tokenizer.encode(prompt.text, add_special_tokens=False)
    # The limit sees the call's name and arguments besides the messages' text.
    text_chars = sum(len(m["content"] or "") for m in MESSAGES)
    call_chars = len("get_current_temperature") + len(str(json.loads(ARGUMENTS)))
    limited = ModelInfo(served_model_name="demo", limits=INFO.limits,
                        serving=type(INFO.serving)(max_prompt_chars=text_chars + call_chars - 1))
    request = ChatCompletionRequest.model_validate({"messages": MESSAGES})
    with pytest.raises(OpenAIError, match=f"a prompt has {text_chars + call_chars} characters"):
        chat_conversation(request.messages, limited, add_generation_prompt=True)
