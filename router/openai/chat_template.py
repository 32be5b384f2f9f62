"""Rendering a conversation with the model's chat template, tools included.

Tools are handed to the template as the request lists them (OpenAI's ``{"type": "function",
"function": {...}}``); where and how they appear is the template's business. A template that
never reads ``tools`` would drop them without a word, and the model would answer as if it had
none: that is refused instead.
"""

from __future__ import annotations

import functools
from typing import Any

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes

NO_TOOL_SUPPORT = "this model's chat template has no tool support"


class NoToolSupportError(ValueError):
    """Tools were given, and the chat template never reads ``tools``."""


def render_chat(tokenizer: Any, conversation: list[dict], *, tools: list[dict] | None = None,
                add_generation_prompt: bool = True, continue_final_message: bool = False,
                **template_kwargs: Any) -> str:
    """The prompt text for a conversation (messages as ``preprocess.chat_conversation`` makes
    them); ``template_kwargs``: extra template variables (vLLM's chat_template_kwargs). Template
    errors (jinja's ``raise_exception``, bad roles) propagate as they are."""
    tools = tools or None  # an empty list is no tools, for templates that test "tools is not none"
    if tools is not None and not template_reads_tools(tokenizer):
        raise NoToolSupportError(NO_TOOL_SUPPORT)
    return tokenizer.apply_chat_template(conversation, tools=tools, tokenize=False,
                                         add_generation_prompt=add_generation_prompt,
                                         continue_final_message=continue_final_message, **template_kwargs)


def template_reads_tools(tokenizer: Any) -> bool:
    """Whether the template the tokenizer uses with tools refers to the ``tools`` variable."""
    template = tokenizer.get_chat_template(tools=[])  # a dict of templates: its "tool_use" one
    return "tools" in _variables(template)


@functools.lru_cache(maxsize=16)
def _variables(template: str) -> frozenset[str]:
    env = jinja2.Environment(extensions=[jinja2.ext.loopcontrols, _GenerationTag])
    return frozenset(jinja2.meta.find_undeclared_variables(env.parse(template)))


class _GenerationTag(jinja2.ext.Extension):
    """Parses transformers' ``{% generation %}...{% endgeneration %}`` (marks assistant text) so
    templates using it can be read; they are never rendered with this environment."""

    tags = frozenset({"generation"})

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)
