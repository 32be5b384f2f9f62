"""The Serve ingress deployment: the OpenAI FastAPI app in front of the worker deployment.

The ingress loads the tokenizer and config.json only (no weights): it
tokenizes, applies chat templates, validates and hashes prompt blocks, so bad
requests stop here. With ``kv`` routing it asks the global scheduler where
each request goes (``KVRoutingClient``) and hands the answer to the request
router inside the ``WorkerRequest``. Requests go to workers through a Serve
handle, streamed one delta per engine step; closing a stream cancels the
handle's response, which cancels the worker-side generator, which aborts the
request in the engine.
"""

from __future__ import annotations

import logging
from typing import Any, AsyncIterator

from ray import serve
from ray.serve.handle import DeploymentHandle

from pagefleet.router.kv_routing import KVRoutingClient, KVRoutingOptions, RoutingCounters
from pagefleet.router.metrics import RouterMetrics
from pagefleet.router.node_metrics import NodeMetricsReader
from pagefleet.router.openai_app import build_openai_app
from pagefleet.router.preprocess import ModelInfo
from pagefleet.router.service import Job, OpenAIService
from pagefleet.worker.config import model_config_of
from pagefleet.worker.engine_args import EngineArgs
from pagefleet.worker.outputs import RequestOutputDelta
from pagefleet.worker.request_check import RequestLimits
from pagefleet.worker.worker_request import WorkerRequest

logger = logging.getLogger(__name__)

INGRESS_DEPLOYMENT_NAME = "OpenAIIngress"


class HandleWorkerClient:
    """``WorkerClient`` over a Serve handle to the worker deployment (and, with ``kv`` routing,
    the global scheduler)."""

    def __init__(self, handle: DeploymentHandle, kv: KVRoutingClient | None = None) -> None:
        self._stream = handle.options(method_name="generate", stream=True)
        self._health = handle.options(method_name="check_health")
        self.kv = kv

    async def route(self, job: Job) -> list[str] | None:
        if self.kv is None:
            return None
        decision = await self.kv.route(job.request_id, job.block_hashes, len(job.token_ids), job.params.max_tokens,
                                       job.params.n)
        return None if decision is None else decision.ranking

    async def generate(self, job: Job) -> AsyncIterator[RequestOutputDelta]:
        response = self._stream.remote(WorkerRequest(job.request_id, job.token_ids, job.params, job.block_hashes,
                                                     job.extra_keys, job.ranking))
        finished = False
        first = True
        try:
            async for delta in response:
                if first and self.kv is not None:
                    self.kv.record_realised(delta.num_cached_tokens)
                first = False
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
    return tokenizer, ModelInfo(served_model_name=cfg.served_model_name, root=str(cfg.path), limits=limits,
                                block_size=args.block_size)


@serve.ingress()
class OpenAIIngress:
    def __init__(self, worker: DeploymentHandle, engine_args: EngineArgs, api_key: str | None = None,
                 kv_scheduler: Any = None, kv_routing: KVRoutingOptions | None = None) -> None:
        """``kv_scheduler``: the global scheduler actor, for ``kv`` routing (None: other policies)."""
        tokenizer, info = load_model_info(engine_args)
        self._metrics = RouterMetrics(default_tags={"model_name": info.served_model_name})
        kv = None if kv_scheduler is None else KVRoutingClient(kv_scheduler, kv_routing or KVRoutingOptions(),
                                                               engine_args.block_size, self._metrics)
        self._client = HandleWorkerClient(worker, kv)
        self._service = OpenAIService(tokenizer=tokenizer, info=info, client=self._client)
        self._api_key = api_key
        logger.info("ingress serves %s (max_model_len %d)", info.served_model_name, info.limits.max_model_len)

    def __serve_build_asgi_app__(self):
        return build_openai_app(self._service, api_key=self._api_key, metrics=self._metrics,
                                node_metrics=NodeMetricsReader())

    async def routing_counters(self) -> RoutingCounters | None:
        """This replica's kv routing counters (None without kv routing), for benchmarks and tests
        (Serve handle call; the HTTP app does not expose them)."""
        return None if self._client.kv is None else self._client.kv.counters

    async def admission_counters(self):
        kv = self._client.kv
        return None if kv is None or kv.admission is None else kv.admission.counters
