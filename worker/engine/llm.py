"""The offline API, shaped like vLLM's ``LLM``."""

from __future__ import annotations

from itertools import count
from typing import Any, Sequence as Seq

from pagefleet.worker.engine.llm_engine import LLMEngine
from pagefleet.worker.engine_args import EngineArgs
from pagefleet.worker.errors import CompileQueueFull
from pagefleet.worker.lora.request import LoRARequest
from pagefleet.worker.outputs import CompletionOutput, RequestOutput, append_output
from pagefleet.worker.sampling_params import SamplingParams


class LLM:
    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        self.engine = LLMEngine(EngineArgs(model=model, **kwargs))
        self.tokenizer = self.engine.tokenizer
        self._ids = count()

    def shutdown(self) -> None:
        self.engine.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def generate(self, prompts: str | dict | Seq[str | dict],
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 priority: int | Seq[int] | None = None,
                 lora_request: LoRARequest | Seq[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in prompt order. ``priority``: one for
        all prompts or one a prompt, as vLLM's (lower first; needs ``scheduling_policy="priority"``
        unless 0). ``lora_request``: one adapter for all prompts or one a prompt (None: the base
        model), as vLLM's; needs ``enable_lora``."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"{len(sampling_params)} sampling params for {len(prompts)} prompts")
        priorities = [priority or 0] * len(prompts) if priority is None or isinstance(priority, int) else list(priority)
        if len(priorities) != len(prompts):
            raise ValueError(f"{len(priorities)} priorities for {len(prompts)} prompts")
        loras = ([lora_request] * len(prompts) if lora_request is None or isinstance(lora_request, LoRARequest)
                 else list(lora_request))
        if len(loras) != len(prompts):
            raise ValueError(f"{len(loras)} lora requests for {len(prompts)} prompts")
        engine = self.engine
        for params in sampling_params:  # distinct grammars compile side by side on the engine's pool
            if params.structured_outputs is not None:
                try:
                    engine.grammars.submit(params.structured_outputs)
                except CompileQueueFull:  # the rest compile as their requests are added
                    break
        order: list[str] = []
        results: dict[str, RequestOutput] = {}
        try:
            for prompt, params, prio, lora in zip(prompts, sampling_params, priorities, loras):
                text, ids = self._prompt_ids(prompt)
                rid = f"offline-{next(self._ids)}"
                engine.add_request(rid, ids, params, priority=prio, lora_request=lora)
                order.append(rid)
                outputs = [CompletionOutput(i, "", [], [] if params.logprobs is not None else None, None)
                           for i in range(params.n)]
                results[rid] = RequestOutput(rid, text, ids, outputs, 0, False)
            while engine.has_unfinished():
                for delta in engine.step():
                    out = results[delta.request_id]
                    out.num_cached_tokens = delta.num_cached_tokens
                    out.finished = delta.finished
                    if delta.prompt_logprobs is not None:
                        out.prompt_logprobs = delta.prompt_logprobs
                    for s in delta.sequences:
                        append_output(out.outputs[s.index], s)
        except BaseException:
            for rid in order:
                engine.abort_request(rid)
            raise
        return [results[rid] for rid in order]

    def _prompt_ids(self, prompt: str | dict) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])
        if isinstance(prompt, dict) and "prompt" in prompt:
            return prompt["prompt"], self.tokenizer.encode(prompt["prompt"])
        raise TypeError(f"a prompt is a string or a dict with 'prompt_token_ids' or 'prompt', got {type(prompt)}")
