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
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Mapping, Protocol, TypeVar

from pagefleet.router.openai import preprocess as pre
from pagefleet.router.openai.errors import OpenAIError, bad_request, internal_error, unavailable
from pagefleet.router.openai.output.reasoning import ReasoningParser
from pagefleet.router.openai.output.responses import ChatResponseBuilder, CompletionResponseBuilder, ResponseBuilder
from pagefleet.router.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from pagefleet.router.openai.request_size import chat_work, check_unstreamed_size
from pagefleet.router.openai.tool_choice import ToolCallOptions, ToolPlan, check_tool_count, tool_plan
from pagefleet.router.openai.tool_parsers import get_tool_parser
from pagefleet.worker import tracing
from pagefleet.worker.aio import merge_streams
from pagefleet.worker.core.block_hash import block_hashes, extra_keys_digest, pack_hashes
from pagefleet.worker.lora.request import LoRAModulePath
from pagefleet.worker.outputs import RequestOutputDelta
from pagefleet.worker.request_check import InvalidRequest
from pagefleet.worker.sampling_params import SamplingParams

T = TypeVar("T")

# Text up to this many characters is tokenized (or templated) on the event loop: short text
# takes less time than handing it to a thread and back adds in latency under load. Longer text
# goes to the tokenizer threads so it never stalls other requests' streams.
INLINE_TEXT_CHARS = 2048
TOKENIZER_THREADS = 2
# Likewise a non-streamed response of up to this many tokens and logprobs is built and encoded on
# the loop; a bigger one on a response thread (threads of their own: a big body waits behind
# another big body, never behind a prompt being tokenized).
INLINE_RESPONSE_TOKENS = 1024
RESPONSE_THREADS = 2


class WorkerClient(Protocol):
    def check_room(self) -> None:
        """Raises OpenAIError (429) when admission control would turn away any request arriving
        now (checked before the request is read, so a refusal costs next to nothing)."""

    async def route(self, job: Job) -> list[str] | None:
        """Where the job should run, best first (None: the request router decides alone).
        Raises OpenAIError (429) when admission control turns it away."""

    def generate(self, job: Job) -> AsyncIterator[RequestOutputDelta]:
        """Deltas of one request, one per engine step; closing the iterator aborts the request."""

    async def check_health(self) -> None:
        """Raises when no worker can serve."""


class OpenAIService:
    def __init__(self, *, tokenizer: Any, info: pre.ModelInfo, client: WorkerClient,
                 tools: ToolCallOptions = ToolCallOptions(), reasoning: ReasoningParser | None = None) -> None:
        self.tokenizer = tokenizer
        self.tools = tools
        self.reasoning = reasoning
        self._tool_parser = get_tool_parser(tools.parser) if tools.parser is not None else None
        self.info = info
        self.client = client
        # LoRA adapters loaded at runtime (``lora_adapters``), by name: empty unless that is allowed.
        self.runtime_loras: dict[str, LoRAModulePath] = {}
        self.draining = False  # shutting down: in-flight requests finish, new ones get 503
        self.num_in_flight = 0  # prepared requests whose response has not ended
        self._tokenizer_pool = ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="pagefleet-tokenize")
        self._response_pool = ThreadPoolExecutor(RESPONSE_THREADS, thread_name_prefix="pagefleet-respond")

    def check_model(self, model: str | None) -> LoRAModulePath | None:
        """The LoRA adapter ``model`` names (None: the base model); a 404 for a name not served."""
        return pre.check_model_name(model, self.info, self.runtime_loras)

    # ---- /v1/completions, /v1/chat/completions --------------------------------------

    async def completion(self, req: CompletionRequest) -> PreparedRequest:
        self._check_open()
        lora = self.check_model(req.model)
        pre.check_request_id(req.request_id, self.info)
        pre.check_not_implemented(req)
        items = pre.completion_prompt_items(req, self.info)
        params = pre.completion_sampling_params(req)
        text_chars = sum(len(p) for p in items if isinstance(p, str))
        prompts = await self._off_loop(text_chars, pre.tokenize_prompts, items, self.tokenizer,
                                       req.add_special_tokens)
        engine_id = f"cmpl-{uuid.uuid4().hex}"
        echo = [(p.text if p.text is not None else self.tokenizer.decode(p.token_ids), p.token_ids)
                for p in prompts] if req.echo else None
        builder = CompletionResponseBuilder(request_id=req.request_id or engine_id,
                                            model=lora.name if lora else self.info.served_model_name,
                                            tokenizer=self.tokenizer, want_logprobs=req.logprobs is not None,
                                            include_usage=_include_usage(req),
                                            tokens_as_ids=bool(req.return_tokens_as_token_ids), n=req.n,
                                            want_prompt_logprobs=req.prompt_logprobs is not None,
                                            echo_prompts=echo)
        return self._prepared(req, builder, engine_id, [p.token_ids for p in prompts], params, lora)

    async def chat(self, req: ChatCompletionRequest) -> PreparedRequest:
        self._check_open()
        lora = self.check_model(req.model)
        pre.check_request_id(req.request_id, self.info)
        pre.check_not_implemented(req)
        pre.check_message_count(req.messages, self.info)
        check_tool_count(req.tools)
        work = chat_work(req.messages, req.tools, INLINE_TEXT_CHARS) + pre.template_kwargs_chars(req)
        plan, params, prompt = await self._off_loop(work, self._chat_prompt, req)
        engine_id = f"chatcmpl-{uuid.uuid4().hex}"
        builder = ChatResponseBuilder(request_id=req.request_id or engine_id,
                                      model=lora.name if lora else self.info.served_model_name,
                                      tokenizer=self.tokenizer, want_logprobs=req.logprobs, include_usage=_include_usage(req),
                                      tool_plan=plan, tokens_as_ids=bool(req.return_tokens_as_token_ids),
                                      reasoning=self.reasoning, n=req.n,
                                      want_prompt_logprobs=req.prompt_logprobs is not None)
        return self._prepared(req, builder, engine_id, [prompt.token_ids], params, lora)

    def _chat_prompt(self, req: ChatCompletionRequest) -> tuple[ToolPlan | None, SamplingParams, pre.PreparedPrompt]:
        """All of a chat request's work that grows with it (its tools, the template, the tokenizer),
        the text's size checked before rendering."""
        plan = tool_plan(req, self._tool_parser, self.tools.enable_auto_tool_choice)
        params = pre.chat_sampling_params(req, plan)
        if self.reasoning is not None and params.structured_outputs is not None:
            # vLLM applies the grammar after the reasoning ends; pagefleet's would constrain the
            # reasoning too, so it refuses instead.
            field = "tool_choice" if plan is not None and plan.structured_outputs is not None else (
                "response_format" if req.response_format is not None else "structured_outputs")
            raise bad_request(f"{field} cannot constrain the answer of a reasoning model "
                              f"(--reasoning-parser {self.reasoning.name}) yet", field)
        conversation = pre.chat_conversation(req.messages, self.info, add_generation_prompt=req.add_generation_prompt,
                                             continue_final_message=req.continue_final_message, tools=req.tools)
        prompt = pre.chat_prompt(conversation, self.tokenizer, add_generation_prompt=req.add_generation_prompt,
                                 continue_final_message=req.continue_final_message,
                                 add_special_tokens=req.add_special_tokens,
                                 tools=plan.tools if plan is not None else None,
                                 template_kwargs=req.chat_template_kwargs)
        return plan, params, prompt

    def _prepared(self, req: CompletionRequest | ChatCompletionRequest, builder: ResponseBuilder, engine_id: str,
                  prompts: list[list[int]], params: SamplingParams,
                  lora: LoRAModulePath | None = None) -> PreparedRequest:
        if req.cache_salt is not None and not 0 < len(req.cache_salt) <= pre.MAX_CACHE_SALT_CHARS:
            raise bad_request(f"cache_salt must be 1 to {pre.MAX_CACHE_SALT_CHARS} characters", "cache_salt")
        limit = self.info.serving.max_prompts_per_request
        if len(prompts) * params.n > limit:
            raise bad_request(f"this request asks for {len(prompts)} prompts x n={params.n} sequences; at most "
                              f"{limit} are allowed in one request (max_prompts_per_request)", "n")
        pre.check_request_priority(req, self.info)
        extra_keys = (req.cache_salt,) if req.cache_salt else ()
        lora_name = lora.name if lora else None
        extra = extra_keys_digest(extra_keys, lora_name)  # no prefix is shared across adapters
        jobs = []
        for i, token_ids in enumerate(pre.truncated_prompt(p, req, self.info) for p in prompts):
            pre.check_job(token_ids, params, self.info, req)
            hashes = pack_hashes(block_hashes(token_ids, self.info.block_size, extra))
            # Engine request ids are the server's own, whatever id the client sent.
            jobs.append(Job(f"{engine_id}-{i}", token_ids, pre.with_max_tokens(params, len(token_ids), self.info),
                            hashes, extra_keys, priority=req.priority, lora_name=lora_name,
                            lora_path=lora.path if lora else None))
        if not req.stream:  # one body holds the whole output: bounded before anything runs
            check_unstreamed_size([job.params for job in jobs], self.info.serving.max_unstreamed_response_tokens,
                                  pre.client_field_names(req))
        # Checked again with no await before the count: a drain that began while this request was
        # being tokenized refuses it, so once draining the count only goes down.
        self._check_open()
        prepared = PreparedRequest(builder, jobs, req.stream)
        self.num_in_flight += 1
        # Called when its response ends; at the latest when it is collected (a stream the server
        # never started, a request dropped on an error).
        prepared.ended = weakref.finalize(prepared, self._request_ended)
        return prepared

    def _request_ended(self) -> None:
        self.num_in_flight -= 1

    async def _off_loop(self, text_chars: int, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` here for short text, on a tokenizer thread for long text."""
        if text_chars <= INLINE_TEXT_CHARS:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_pool, fn, *args)

    async def _respond_off_loop(self, prepared: PreparedRequest, fn: Callable[[], T]) -> T:
        """``fn()`` here for a small response, on a response thread for a big one."""
        builder = prepared.builder
        per_token = 1 + (prepared.jobs[0].params.logprobs or 0) if builder.want_logprobs else 1
        if builder.usage.completion_tokens * per_token <= INLINE_RESPONSE_TOKENS:
            return fn()
        return await asyncio.get_running_loop().run_in_executor(self._response_pool, fn)

    def check_open(self) -> None:
        """Raises 503 while draining and 429 when admission control is refusing every newcomer:
        called before a request's body is read."""
        self._check_open()
        if self.client is not None:  # a service built without workers (tokenize only) admits nothing
            self.client.check_room()

    def _check_open(self) -> None:
        if self.draining:
            raise unavailable("the server is shutting down; retry on another replica", retry_after_s=5,
                              code="draining")

    # ---- draining (graceful shutdown) -----------------------------------------------------

    def stop_admitting(self) -> int:
        """Refuse new requests from now on (503 ``draining``, ``/health`` 503); returns how many
        are in flight."""
        self.draining = True
        return self.num_in_flight

    async def drain(self, timeout_s: float) -> int:
        """Refuse new requests from now on and wait up to ``timeout_s`` for the in-flight ones;
        returns how many were still running when it gave up (0: all finished)."""
        self.stop_admitting()
        deadline = asyncio.get_running_loop().time() + timeout_s
        while self.num_in_flight and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
        return self.num_in_flight

    # ---- running jobs ------------------------------------------------------------------

    def trace(self, prepared: PreparedRequest, headers: Mapping[str, str], started: float) -> None:
        """Opens each job's span (when tracing is on), from when its HTTP handler ``started``,
        continuing the client's trace if ``headers`` carry one."""
        for job in prepared.jobs:
            job.span = tracing.start_span("pagefleet.request", headers, started, {
                "pagefleet.request_id": job.request_id, "gen_ai.request.model": self.info.served_model_name,
                "gen_ai.usage.prompt_tokens": len(job.token_ids), "gen_ai.request.n": job.params.n})
            tracing.event(job.span, "prepared")

    async def admit(self, prepared: PreparedRequest) -> None:
        """Ask where each job goes, before any response starts (a 429 must be a whole response)."""
        try:
            for job in prepared.jobs:
                job.ranking = await self.client.route(job)
                tracing.event(job.span, "routed")
        except BaseException as exc:
            prepared.ended()
            for job in prepared.jobs:
                _end_span(job, exc)
            raise

    async def run_to_completion(self, prepared: PreparedRequest) -> dict:
        """All prompts run concurrently; the response is built once every one has finished."""
        await self._accumulate(prepared)
        return await self._respond_off_loop(prepared, prepared.builder.full_response)

    async def run_to_completion_json(self, prepared: PreparedRequest) -> bytes:
        """``run_to_completion``'s response as its JSON body, built and encoded in one go."""
        await self._accumulate(prepared)
        return await self._respond_off_loop(prepared, prepared.builder.full_response_json)

    async def _accumulate(self, prepared: PreparedRequest) -> None:
        builder, jobs = prepared.builder, prepared.jobs
        try:
            async for job_index, delta in self._merged(prepared):
                builder.record_prompt_logprobs(job_index, delta.prompt_logprobs)
                for seq in delta.sequences:
                    builder.accumulate(job_index * jobs[job_index].params.n + seq.index, seq)
        finally:
            prepared.ended()

    async def stream_chunks(self, prepared: PreparedRequest) -> AsyncIterator[dict]:
        builder, jobs = prepared.builder, prepared.jobs
        n = jobs[0].params.n
        try:
            for chunk in builder.role_chunks(list(range(len(jobs) * n))):
                yield chunk
            async for job_index, delta in self._merged(prepared):
                builder.record_prompt_logprobs(job_index, delta.prompt_logprobs)
                for seq in delta.sequences:
                    chunk = builder.delta_chunk(job_index * n + seq.index, seq)
                    if chunk is not None:
                        yield chunk
            if builder.include_usage:
                yield builder.usage_chunk()
        finally:
            prepared.ended()

    async def _merged(self, prepared: PreparedRequest) -> AsyncIterator[tuple[int, RequestOutputDelta]]:
        """Deltas of every job as they come; leaving early closes every worker stream."""
        builder, jobs = prepared.builder, prepared.jobs
        streams = [_counting(builder, i, job, self.client.generate(job)) for i, job in enumerate(jobs)]
        async for item in merge_streams(streams):
            yield item

    # ---- /tokenize, /detokenize --------------------------------------------------------

    async def tokenize(self, req: TokenizeRequest) -> dict:
        self.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise bad_request("give exactly one of prompt and messages", "prompt")
        if req.messages is not None:
            add_special = False if req.add_special_tokens is None else req.add_special_tokens
            pre.check_message_count(req.messages, self.info)
            check_tool_count(req.tools)
            ids = (await self._off_loop(chat_work(req.messages, req.tools, INLINE_TEXT_CHARS),
                                        self._tokenize_chat, req, add_special)).token_ids
        else:
            add_special = True if req.add_special_tokens is None else req.add_special_tokens
            pre.check_prompt_chars(len(req.prompt), self.info, "prompt")
            ids = (await self._off_loop(len(req.prompt), pre.tokenize_prompts, [req.prompt], self.tokenizer,
                                        add_special))[0].token_ids
        out = {"count": len(ids), "max_model_len": self.info.limits.max_model_len, "tokens": ids}
        if req.return_token_strs:
            out["token_strs"] = self.tokenizer.convert_ids_to_tokens(ids)
        return out

    def _tokenize_chat(self, req: TokenizeRequest, add_special_tokens: bool) -> pre.PreparedPrompt:
        conversation = pre.chat_conversation(req.messages, self.info, add_generation_prompt=req.add_generation_prompt,
                                             tools=req.tools)
        return pre.chat_prompt(conversation, self.tokenizer, add_generation_prompt=req.add_generation_prompt,
                               add_special_tokens=add_special_tokens,
                               tools=[t.model_dump(exclude_none=True) for t in req.tools or []])

    async def detokenize(self, req: DetokenizeRequest) -> dict:
        self.check_model(req.model)
        limit = self.info.limits.max_model_len
        if len(req.tokens) > limit:  # longer than any sequence the engine makes
            raise bad_request(f"tokens holds {len(req.tokens)} ids; at most {limit} (max_model_len)", "tokens")
        vocab_size = self.info.limits.vocab_size
        bad = next((t for t in req.tokens if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise bad_request(f"token id {bad} is outside the vocabulary [0, {vocab_size})", "tokens")
        return {"prompt": await self._off_loop(len(req.tokens), self.tokenizer.decode, req.tokens)}

    def models(self) -> dict:
        # root names the model, never the checkpoint's (or an adapter's) path on the server
        root = self.info.served_model_name
        card = {"object": "model", "created": 0, "owned_by": "pagefleet", "max_model_len": self.info.limits.max_model_len}
        base = [{"id": name, "root": root, "parent": None, **card} for name in (root, *self.info.more_names)]
        # LoRA adapters as vLLM lists them: their parent is the base model (or the one they name)
        adapters = [{"id": m.name, "root": m.name, "parent": m.base_model_name or root, **card}
                    for m in (*self.info.lora_modules, *self.runtime_loras.values())]
        return {"object": "list", "data": base + adapters}


@dataclass(slots=True, weakref_slot=True)
class Job:
    """One engine request of an HTTP request (a completions request has one per prompt)."""

    request_id: str  # the server's: f"{engine id}-{prompt index}"
    token_ids: list[int]
    params: SamplingParams
    block_hashes: bytes = b""  # the prompt's full-block hashes, packed
    extra_keys: tuple = ()  # the cache salt, when the request has one
    ranking: list[str] | None = None  # where the global scheduler would run it, best first
    span: Any = None  # its span while tracing is on (``worker.tracing``)
    client: str = ""  # the client's address, as the ingress sees it (``WorkerRequest.client``)
    priority: int = 0  # vLLM's request priority (``WorkerRequest.priority``)
    lora_name: str | None = None  # the LoRA adapter its model names (``WorkerRequest.lora_name``)
    lora_path: str | None = None  # where that adapter is read from (``WorkerRequest.lora_path``)


@dataclass(slots=True, weakref_slot=True)
class PreparedRequest:
    """A checked request, ready to run: its response builder and its engine requests."""

    builder: ResponseBuilder
    jobs: list[Job]
    stream: bool
    ended: Callable[[], None] = lambda: None  # leaves the service's in-flight count (once)


def _include_usage(req: CompletionRequest | ChatCompletionRequest) -> bool:
    return bool(req.stream_options and req.stream_options.include_usage)


async def _counting(builder: ResponseBuilder, index: int, job: Job,
                    stream: AsyncIterator[RequestOutputDelta]) -> AsyncIterator[tuple[int, RequestOutputDelta]]:
    """Tags deltas with their job and counts each request's prompt once; worker errors
    become OpenAI errors (a request the engine refused is still the client's fault; anything
    else is a 500 whose details stay in the server log). Ends the job's span."""
    first, error = True, None
    try:
        async for delta in stream:
            if first:
                builder.count_request(delta)
                tracing.event(job.span, "first_delta")
                first = False
            yield index, delta
    except OpenAIError as exc:
        error = exc
        raise
    except InvalidRequest as exc:
        error = bad_request(str(exc), exc.param, exc.code)
        raise error from exc
    except Exception as exc:
        error = internal_error(exc)
        raise error from exc
    finally:
        close = getattr(stream, "aclose", None)
        if close is not None:
            await close()
        _end_span(job, error)


def _end_span(job: Job, error: BaseException | None) -> None:
    tracing.end(job.span, error)
    job.span = None


