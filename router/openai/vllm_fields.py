"""The fields of vLLM's OpenAI request models that pagefleet does not implement, each with the
value vLLM takes when a client leaves it out: a request that sets one to anything else is
refused with a 400 naming it, rather than answered as if it had not asked
(``preprocess.check_not_implemented``). ``tests/router/openai/test_vllm_fields.py`` holds
this table and the request models to vLLM's own field lists (``tests/data``)."""

from __future__ import annotations

from typing import Any

_SHARED: dict[str, Any] = {
    "priority": 0,  # no --scheduling-policy priority
    "use_beam_search": False,
    "length_penalty": 1.0,  # beam search's
    "spaces_between_special_tokens": True,
    "logprob_token_ids": None,
    "return_token_ids": None,
    "return_token_offsets": False,
    "stream_interval": None,  # the server's --stream-interval applies to every stream
    "thinking_token_budget": None,
    "repetition_detection": None,
    "watermarking": None,
    "vllm_xargs": None,
    "kv_transfer_params": None,
    "ec_transfer_params": None,
    "prompt_embeds": None,
    "mm_payload": "tensors",
    "return_mm_kwargs": None,
    "routed_experts_prompt_start": 0,
    "session_id": None,
}

NOT_IMPLEMENTED: dict[str, dict[str, Any]] = {
    "completions": {**_SHARED},
    "chat_completions": {
        **_SHARED,
        "echo": False,  # completions declares echo (and refuses it in preprocess)
        "chat_template": None,  # a template of the client's: pagefleet renders the model's own only
        "documents": None,
        "include_reasoning": True,  # no --reasoning-parser: there is no reasoning to leave out
        "reasoning_effort": None,
        "media_io_kwargs": None,
        "mm_processor_kwargs": None,
        "return_prompt_text": None,
    },
}
