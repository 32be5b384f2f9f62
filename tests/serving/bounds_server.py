"""The OpenAI app under uvicorn in a process of its own, for tests that time its event loop while it
serves big requests: the real app, tokenizer and chat template (one that renders tools), and a
worker that returns whole outputs at once (``BulkWorker``), so a big response costs the server its
building and encoding, not its generation.

Run: ``python bounds_server.py --max-model-len N [--max-prompt-chars N]
[--max-unstreamed-response-tokens N]``; prints ``PORT <n>`` once listening on 127.0.0.1.
Only tests run this.
"""

from __future__ import annotations

import argparse
import asyncio
import socket

import uvicorn

from pagefleet.router.openai.app import build_openai_app, freeze_loaded_objects
from pagefleet.router.openai.preprocess import ModelInfo, ServingLimits, longest_token_chars
from pagefleet.router.openai.service import OpenAIService
from pagefleet.worker.outputs import CompletionOutput, RequestOutputDelta, TokenLogprob
from pagefleet.worker.request_check import RequestLimits

from serving_fakes import CHAT_TEMPLATE, MODEL, make_tokenizer

# The test's template: every tool as JSON, then the conversation (as Hermes-style templates do).
TOOLS_TEMPLATE = "{% for tool in tools or [] %}<tool>{{ tool | tojson }}</tool>\n{% endfor %}" + CHAT_TEMPLATE
CHUNK_TOKENS = 64  # tokens of one sequence in one delta


def make_tools_tokenizer():
    tokenizer = make_tokenizer()
    tokenizer.chat_template = TOOLS_TEMPLATE
    return tokenizer


class BulkWorker:
    """Every sequence of a request is ``max_tokens`` tokens (ids 5, 6, 7, ... in turn), each with
    ``logprobs`` top entries, sent ``CHUNK_TOKENS`` at a time; the objects of one chunk are shared
    by every sequence and delta, so the worker's own cost is next to nothing."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def check_room(self) -> None:
        pass

    async def route(self, job) -> None:
        return None

    async def check_health(self) -> None:
        pass

    async def generate(self, job):
        params = job.params
        ids = [5 + i % 3 for i in range(CHUNK_TOKENS)]
        text = self.tokenizer.decode(ids)
        logprobs = None
        if params.logprobs is not None:
            top = [(5 + k, -1.0 - k) for k in range(params.logprobs)]
            logprobs = [TokenLogprob(t, -1.0, top) for t in ids]
        sent = 0
        while sent < params.max_tokens:
            count = min(CHUNK_TOKENS, params.max_tokens - sent)
            sent += count
            last = sent == params.max_tokens
            seqs = [CompletionOutput(i, text if count == CHUNK_TOKENS else self.tokenizer.decode(ids[:count]),
                                     ids[:count], None if logprobs is None else logprobs[:count],
                                     "length" if last else None) for i in range(params.n)]
            yield RequestOutputDelta(job.request_id, seqs, len(job.token_ids), 0, last)
            await asyncio.sleep(0)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-model-len", type=int, required=True)
    parser.add_argument("--max-prompt-chars", type=int)
    parser.add_argument("--max-unstreamed-response-tokens", type=int)
    args = parser.parse_args()
    tokenizer = make_tools_tokenizer()
    bounds = {} if args.max_unstreamed_response_tokens is None else \
        {"max_unstreamed_response_tokens": args.max_unstreamed_response_tokens}
    serving = ServingLimits(max_prompt_chars=args.max_prompt_chars or
                            args.max_model_len * longest_token_chars(tokenizer), **bounds)
    info = ModelInfo(served_model_name=MODEL, serving=serving,
                     limits=RequestLimits(vocab_size=len(tokenizer), max_model_len=args.max_model_len,
                                          max_num_seqs=256))
    app = build_openai_app(OpenAIService(tokenizer=tokenizer, info=info, client=BulkWorker(tokenizer)))
    freeze_loaded_objects()  # as the ingress does once its app is built
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    print(f"PORT {sock.getsockname()[1]}", flush=True)
    uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off")).run(sockets=[sock])


if __name__ == "__main__":
    main()
