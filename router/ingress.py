"""The Serve ingress deployment: the OpenAI FastAPI app in front of the worker deployment.

The ingress loads the tokenizer and config.json only (no weights): it
tokenizes, applies chat templates and validates, so bad requests stop here.
Requests go to workers through a Serve handle, streamed one delta per engine
step; closing a stream cancels the handle's response, which cancels the
worker-side generator, which aborts the request in the engine.
"""

from __future__ import annotations

import logging
from typing import Any, AsyncIterator

from ray import serve
from ray.serve.handle import DeploymentHandle

from pagefleet.router.metrics import RouterMetrics
from pagefleet.router.node_metrics import NodeMetricsReader
from pagefleet.router.openai_app import build_openai_app
from pagefleet.router.preprocess import ModelInfo
from pagefleet.router.service import OpenAIService
from pagefleet.worker.config import model_config_of
from pagefleet.worker.engine_args import EngineArgs
from pagefleet.worker.outputs import RequestOutputDelta
from pagefleet.worker.request_check import RequestLimits
from pagefleet.worker.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

INGRESS_DEPLOYMENT_NAME = "OpenAIIngress"


class HandleWorkerClient:
    """``WorkerClient`` over a Serve handle to the worker deployment."""

    def __init__(self, handle: DeploymentHandle) -> None:
        self._stream = handle.options(method_name="generate", stream=True)
        self._health = handle.options(method_name="check_health")

    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams) -> AsyncIterator[RequestOutputDelta]:
        response = self._stream.remote(request_id, prompt_token_ids, params)
        finished = False
        try:
            async for delta in response:
                finished = delta.finished
                yield delta
        finally:
            if not finished:
                response.cancel()

    async def check_health(self) -> None:
        await self._health.remote()


def load_model_info(args: EngineArgs) -> tuple[Any, ModelInfo]:
    """The tokenizer and ``ModelInfo`` from the checkpoint's config and tokenizer files,
    read exactly as the engine reads them (same max_model_len, same name, same limits)."""
    from transformers import AutoTokenizer

    cfg = model_config_of(args)
    tokenizer = AutoTokenizer.from_pretrained(str(cfg.path))
    limits = RequestLimits(vocab_size=cfg.vocab_size, max_model_len=cfg.max_model_len,
                           max_num_seqs=args.max_num_seqs)
    return tokenizer, ModelInfo(served_model_name=cfg.served_model_name, root=str(cfg.path), limits=limits)


@serve.ingress()
class OpenAIIngress:
    def __init__(self, worker: DeploymentHandle, engine_args: EngineArgs, api_key: str | None = None) -> None:
        tokenizer, info = load_model_info(engine_args)
        self._service = OpenAIService(tokenizer=tokenizer, info=info, client=HandleWorkerClient(worker))
        self._api_key = api_key
        self._metrics = RouterMetrics(default_tags={"model_name": info.served_model_name})
        logger.info("ingress serves %s (max_model_len %d)", info.served_model_name, info.limits.max_model_len)

    def __serve_build_asgi_app__(self):
        return build_openai_app(self._service, api_key=self._api_key, metrics=self._metrics,
                                node_metrics=NodeMetricsReader())
