"""pagefleet.worker — the engine: model, paged KV cache, scheduler, sampler, detokenizer.

Runs without Ray at tensor_parallel_size 1; Ray appears only in the adapters
(``deployment.py`` for Serve, ``tp_executor.py`` / ``tp_placement.py`` / ``tp_worker.py`` for TP ranks).
"""

from pagefleet.worker.engine_args import EngineArgs
from pagefleet.worker.outputs import CompletionOutput, RequestOutput, RequestOutputDelta
from pagefleet.worker.sampling_params import SamplingParams, StructuredOutputsParams


def __getattr__(name: str):
    # Heavy imports (torch, transformers) only when the engine is actually asked for.
    if name == "LLM":
        from pagefleet.worker.engine.llm import LLM
        return LLM
    if name == "LLMEngine":
        from pagefleet.worker.engine.llm_engine import LLMEngine
        return LLMEngine
    if name == "AsyncLLMEngine":
        from pagefleet.worker.engine.async_engine import AsyncLLMEngine
        return AsyncLLMEngine
    raise AttributeError(name)


__all__ = ["LLM", "LLMEngine", "AsyncLLMEngine", "EngineArgs", "SamplingParams", "StructuredOutputsParams",
           "RequestOutput", "CompletionOutput", "RequestOutputDelta"]
