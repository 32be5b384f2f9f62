"""The Serve ingress deployment: the OpenAI FastAPI app in front of the worker deployment.

The ingress loads the tokenizer and config.json only (no weights): it
tokenizes, applies chat templates and validates, so bad requests stop here.
Requests go to workers through a Serve handle, streamed one delta per engine
step; closing a stream cancels the handle's response, which cancels the
worker-side generator, which aborts the request in the engine.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, AsyncIterator

from ray import serve
from ray.serve.handle import DeploymentHandle

from pagefleet.router.http_guards import BodyLimits
from pagefleet.router.openai_app import build_openai_app
from pagefleet.router.preprocess import ModelInfo, ServingLimits, longest_token_chars
from pagefleet.router.service import OpenAIService
from pagefleet.router.worker_errors import WorkerHealth, worker_failure
from pagefleet.worker.config import model_config_of
from pagefleet.worker.engine_args import EngineArgs
from pagefleet.worker.outputs import RequestOutputDelta
from pagefleet.worker.request_check import RequestLimits
from pagefleet.worker.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

INGRESS_DEPLOYMENT_NAME = "OpenAIIngress"
# A request that has produced nothing yet is tried again on another replica when its worker dies
# (or is unreachable) before answering: nothing was sent, so nothing is repeated.
MAX_ATTEMPTS = 3


class HandleWorkerClient:
    """``WorkerClient`` over a Serve handle to the worker deployment."""

    def __init__(self, handle: DeploymentHandle, health: WorkerHealth | None = None) -> None:
        self._stream = handle.options(method_name="generate", stream=True)
        self._health = health or WorkerHealth(handle.deployment_name)

    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams) -> AsyncIterator[RequestOutputDelta]:
        for attempt in range(1, MAX_ATTEMPTS + 1):
            response = None
            started = finished = False
            try:
                response = self._stream.remote(request_id, prompt_token_ids, params)  # may refuse: queues full
                async for delta in response:
                    started = True
                    finished = delta.finished
                    yield delta
                return
            except Exception as exc:  # noqa: BLE001 — each becomes an OpenAI error (or a retry) below
                error, retry = worker_failure(exc)
                if not retry or started or attempt == MAX_ATTEMPTS:
                    raise error from None
                logger.warning("request %s: worker unavailable before its first output (%s); attempt %d of %d",
                               request_id, type(exc).__name__, attempt + 1, MAX_ATTEMPTS)
            finally:
                if response is not None and not finished:
                    with contextlib.suppress(Exception):  # a refused or failed call re-raises on cancel
                        response.cancel()

    async def check_health(self) -> None:
        await self._health.check()


def load_model_info(args: EngineArgs, serving: ServingLimits = ServingLimits()) -> tuple[Any, ModelInfo]:
    """The tokenizer and ``ModelInfo`` from the checkpoint's config and tokenizer files,
    read exactly as the engine reads them (same max_model_len, same name, same limits)."""
    from transformers import AutoTokenizer

    cfg = model_config_of(args)
    tokenizer = AutoTokenizer.from_pretrained(str(cfg.path), trust_remote_code=False)
    if serving.max_prompt_chars is None:
        serving = ServingLimits(serving.max_prompts_per_request, cfg.max_model_len * longest_token_chars(tokenizer),
                                serving.max_request_id_chars)
    return tokenizer, ModelInfo(served_model_name=cfg.served_model_name, limits=RequestLimits.of(cfg, args),
                                serving=serving)


@serve.ingress()
class OpenAIIngress:
    def __init__(self, worker: DeploymentHandle, engine_args: EngineArgs, *, api_key: str | None = None,
                 serving: ServingLimits = ServingLimits(), body_limits: BodyLimits = BodyLimits(),
                 drain_timeout_s: float = 30.0) -> None:
        tokenizer, info = load_model_info(engine_args, serving)
        self._service = OpenAIService(tokenizer=tokenizer, info=info, client=HandleWorkerClient(worker))
        self._api_key = api_key
        self._body_limits = body_limits
        self._drain_timeout_s = drain_timeout_s
        logger.info("ingress serves %s (max_model_len %d)", info.served_model_name, info.limits.max_model_len)

    def __serve_build_asgi_app__(self):
        return build_openai_app(self._service, api_key=self._api_key, body_limits=self._body_limits)

    async def drain(self) -> tuple[str, int]:
        """Graceful shutdown: new requests get 503 from now on; waits up to drain_timeout_s for
        the in-flight ones. Returns this replica's id and how many were still running."""
        left = await self._service.drain(self._drain_timeout_s)
        return serve.get_replica_context().replica_id.unique_id, left
