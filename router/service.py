"""The OpenAI endpoints' logic between HTTP and the workers, with no Ray in it.

``OpenAIService`` validates and tokenizes (``preprocess``), hashes each
prompt's full blocks once (the shared block hash, salted with the request's
``cache_salt``), asks the ``WorkerClient`` where each prompt should go (that is
where admission control may refuse it: a 429 before any response starts),
sends it to a worker (a Serve handle in production, a fake in tests), and
shapes the deltas into responses (``responses``). Closing a stream closes
every worker stream under it, which aborts those requests.
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator, Protocol

from pagefleet.router import preprocess as pre
from pagefleet.router.errors import OpenAIError, bad_request
from pagefleet.router.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from pagefleet.router.responses import ChatResponseBuilder, CompletionResponseBuilder, ResponseBuilder
from pagefleet.router.sse import internal_error
from pagefleet.worker.block_hash import block_hashes
from pagefleet.worker.kv_events import pack_hashes
from pagefleet.worker.outputs import RequestOutputDelta
from pagefleet.worker.sampling_params import SamplingParams


class WorkerClient(Protocol):
    async def route(self, job: Job) -> list[str] | None:
        """Where the job should run, best first (None: the request router decides alone).
        Raises OpenAIError (429) when admission control turns it away."""

    def generate(self, job: Job) -> AsyncIterator[RequestOutputDelta]:
        """Deltas of one request, one per engine step; closing the iterator aborts the request."""

    async def check_health(self) -> None:
        """Raises when no worker can serve."""


class OpenAIService:
    def __init__(self, *, tokenizer: Any, info: pre.ModelInfo, client: WorkerClient) -> None:
        self.tokenizer = tokenizer
        self.info = info
        self.client = client

    # ---- /v1/completions, /v1/chat/completions --------------------------------------

    def completion(self, req: CompletionRequest) -> PreparedRequest:
        pre.check_model_name(req.model, self.info)
        prompts = pre.completion_prompts(req, self.tokenizer)
        params = pre.completion_sampling_params(req)
        builder = CompletionResponseBuilder(request_id=req.request_id or f"cmpl-{uuid.uuid4().hex}",
                                            model=self.info.served_model_name, tokenizer=self.tokenizer,
                                            want_logprobs=req.logprobs is not None,
                                            include_usage=_include_usage(req))
        return self._prepared(req, builder, [p.token_ids for p in prompts], params)

    def chat(self, req: ChatCompletionRequest) -> PreparedRequest:
        pre.check_model_name(req.model, self.info)
        prompt = pre.chat_prompt(req.messages, self.tokenizer, add_generation_prompt=req.add_generation_prompt,
                                 continue_final_message=req.continue_final_message,
                                 add_special_tokens=req.add_special_tokens)
        params = pre.chat_sampling_params(req)
        builder = ChatResponseBuilder(request_id=req.request_id or f"chatcmpl-{uuid.uuid4().hex}",
                                      model=self.info.served_model_name, tokenizer=self.tokenizer,
                                      want_logprobs=req.logprobs, include_usage=_include_usage(req))
        return self._prepared(req, builder, [prompt.token_ids], params)

    def _prepared(self, req: CompletionRequest | ChatCompletionRequest, builder: ResponseBuilder,
                  prompts: list[list[int]], params: SamplingParams) -> PreparedRequest:
        if req.cache_salt is not None and not req.cache_salt:
            raise bad_request("cache_salt must be a non-empty string", "cache_salt")
        extra_keys = (req.cache_salt,) if req.cache_salt else ()
        jobs = []
        for i, token_ids in enumerate(prompts):
            pre.check_job(token_ids, params, self.info, req)
            hashes = pack_hashes(block_hashes(token_ids, self.info.block_size, extra_keys))
            jobs.append(Job(f"{builder.id}-{i}", token_ids, pre.with_max_tokens(params, len(token_ids), self.info),
                            hashes, extra_keys))
        return PreparedRequest(builder, jobs, req.stream)

    # ---- running jobs ------------------------------------------------------------------

    async def admit(self, prepared: PreparedRequest) -> None:
        """Ask where each job goes, before any response starts (a 429 must be a whole response)."""
        for job in prepared.jobs:
            job.ranking = await self.client.route(job)

    async def run_to_completion(self, prepared: PreparedRequest) -> dict:
        """All prompts run concurrently; the response is built once every one has finished."""
        builder, jobs = prepared.builder, prepared.jobs
        async for job_index, delta in self._merged(builder, jobs):
            for seq in delta.sequences:
                builder.accumulate(job_index * jobs[job_index].params.n + seq.index, seq)
        return builder.full_response()

    async def stream_chunks(self, prepared: PreparedRequest) -> AsyncIterator[dict]:
        builder, jobs = prepared.builder, prepared.jobs
        n = jobs[0].params.n
        for chunk in builder.role_chunks(list(range(len(jobs) * n))):
            yield chunk
        async for job_index, delta in self._merged(builder, jobs):
            for seq in delta.sequences:
                chunk = builder.delta_chunk(job_index * n + seq.index, seq)
                if chunk is not None:
                    yield chunk
        if builder.include_usage:
            yield builder.usage_chunk()

    async def _merged(self, builder: ResponseBuilder, jobs: list[Job]) -> AsyncIterator[tuple[int, RequestOutputDelta]]:
        """Deltas of every job as they come; leaving early closes every worker stream."""
        streams = [_counting(builder, i, self.client.generate(job)) for i, job in enumerate(jobs)]
        if len(streams) == 1:  # the common case needs no tasks
            try:
                async for item in streams[0]:
                    yield item
            finally:
                await streams[0].aclose()
            return
        queue: asyncio.Queue = asyncio.Queue()
        tasks = [asyncio.create_task(_pump(s, queue)) for s in streams]
        try:
            remaining = len(tasks)
            while remaining:
                item = await queue.get()
                if item is _FINISHED:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield item
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    # ---- /tokenize, /detokenize --------------------------------------------------------

    def tokenize(self, req: TokenizeRequest) -> dict:
        pre.check_model_name(req.model, self.info)
        if (req.prompt is None) == (req.messages is None):
            raise bad_request("give exactly one of prompt and messages", "prompt")
        if req.messages is not None:
            add_special = False if req.add_special_tokens is None else req.add_special_tokens
            ids = pre.chat_prompt(req.messages, self.tokenizer, add_generation_prompt=req.add_generation_prompt,
                                  add_special_tokens=add_special).token_ids
        else:
            add_special = True if req.add_special_tokens is None else req.add_special_tokens
            ids = list(self.tokenizer.encode(req.prompt, add_special_tokens=add_special))
        out = {"count": len(ids), "max_model_len": self.info.limits.max_model_len, "tokens": ids}
        if req.return_token_strs:
            out["token_strs"] = self.tokenizer.convert_ids_to_tokens(ids)
        return out

    def detokenize(self, req: DetokenizeRequest) -> dict:
        pre.check_model_name(req.model, self.info)
        vocab_size = self.info.limits.vocab_size
        bad = next((t for t in req.tokens if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise bad_request(f"token id {bad} is outside the vocabulary [0, {vocab_size})", "tokens")
        return {"prompt": self.tokenizer.decode(req.tokens)}

    def models(self) -> dict:
        return {"object": "list", "data": [{
            "id": self.info.served_model_name, "object": "model", "created": 0, "owned_by": "pagefleet",
            "root": self.info.root, "parent": None, "max_model_len": self.info.limits.max_model_len}]}


@dataclass(slots=True)
class Job:
    """One engine request of an HTTP request (a completions request has one per prompt)."""

    request_id: str
    token_ids: list[int]
    params: SamplingParams
    block_hashes: bytes = b""  # the prompt's full-block hashes, packed
    extra_keys: tuple = ()  # the cache salt, when the request has one
    ranking: list[str] | None = None  # where the global scheduler would run it, best first


@dataclass(slots=True)
class PreparedRequest:
    """A checked request, ready to run: its response builder and its engine requests."""

    builder: ResponseBuilder
    jobs: list[Job]
    stream: bool


def _include_usage(req: CompletionRequest | ChatCompletionRequest) -> bool:
    return bool(req.stream_options and req.stream_options.include_usage)


_FINISHED = object()


async def _counting(builder: ResponseBuilder, index: int,
                    stream: AsyncIterator[RequestOutputDelta]) -> AsyncIterator[tuple[int, RequestOutputDelta]]:
    """Tags deltas with their job and counts each request's prompt once; worker errors
    become OpenAI errors (a ValueError the ingress missed is still the client's fault)."""
    first = True
    try:
        async for delta in stream:
            if first:
                builder.count_request(delta)
                first = False
            yield index, delta
    except OpenAIError:
        raise
    except ValueError as exc:
        raise bad_request(str(exc)) from exc
    except Exception as exc:
        raise internal_error(exc) from exc
    finally:
        close = getattr(stream, "aclose", None)
        if close is not None:
            await close()


async def _pump(stream: AsyncIterator, queue: asyncio.Queue) -> None:
    try:
        async for item in stream:
            await queue.put(item)
        await queue.put(_FINISHED)
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # handed to the consumer, which raises it
        await queue.put(exc)
    finally:
        await stream.aclose()
