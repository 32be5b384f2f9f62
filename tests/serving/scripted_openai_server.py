"""A minimal OpenAI-compatible streaming server with scripted timing, for testing clients.

Every request streams ``max_tokens`` one-token chunks: the first ``--ttft-ms`` after the
request arrived, then one each ``--itl-ms``, each at its absolute deadline (so a late wake-up
does not push the rest back). It appends what it actually did to ``--log`` (JSON lines:
the x-request-id header, arrival and send times on the monotonic clock, which the client's ``time.perf_counter``
shares on Linux), so a test compares a client's figures with the truth, not with the script.

Scripted failures: request number ``--http-error-on`` (0-based) answers HTTP 500, and
``--cut-on`` breaks its stream after two chunks without finishing.

``--keepalive-s`` closes a kept-alive connection idle that long (uvicorn, which ``vllm serve``
runs, closes them after 5 s).

Run: ``python scripted_openai_server.py --port 0 --log FILE``; it prints ``PORT <n>`` once
listening on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import time

from aiohttp import web

MODEL = "scripted-model"


def build_app(args: argparse.Namespace) -> web.Application:
    numbers = itertools.count()
    log = open(args.log, "a", buffering=1) if args.log else None

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": args.model, "object": "model", "owned_by": "test"}]})

    async def generate(request: web.Request) -> web.StreamResponse:
        arrived = time.perf_counter()
        number = next(numbers)
        body = await request.json()
        chat = request.path.endswith("/chat/completions")
        if number == args.http_error_on:
            return web.json_response({"error": {"message": "scripted failure", "type": "server_error",
                                                "param": None, "code": 500}}, status=500)
        n = body.get("max_completion_tokens" if chat else "max_tokens") or 16
        prompt = body["messages"][-1]["content"] if chat else body["prompt"]
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        if chat:  # OpenAI opens a chat stream with the role, before any token
            await _send(resp, _chunk(chat, {"role": "assistant", "content": ""}, None))
        sent = []
        for i in range(n):
            delay = arrived + (args.ttft_ms + i * args.itl_ms) / 1e3 - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            if number == args.cut_on and i == 2:
                request.transport.close()  # the stream breaks off mid-response
                return resp
            finish = "length" if i == n - 1 else None
            await _send(resp, _chunk(chat, {"content": f" t{i}"} if chat else f" t{i}", finish))
            sent.append(time.perf_counter())
        if log:  # before the stream ends, so a client that saw the end finds the line
            log.write(json.dumps({"number": number, "request_id": request.headers.get("x-request-id"),
                                  "arrived": arrived, "sent": sent}) + "\n")
        usage = {"prompt_tokens": len(str(prompt).split()), "completion_tokens": n,
                 "total_tokens": len(str(prompt).split()) + n, "prompt_tokens_details": {"cached_tokens": 3}}
        await _send(resp, {"id": "x", "object": "chat.completion.chunk" if chat else "text_completion",
                           "model": MODEL, "choices": [], "usage": usage})
        await resp.write(b"data: [DONE]\n\n")
        return resp

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", generate)
    app.router.add_post("/v1/chat/completions", generate)
    return app


def _chunk(chat: bool, piece, finish: str | None) -> dict:
    if chat:
        choice = {"index": 0, "delta": piece, "finish_reason": finish}
    else:
        choice = {"index": 0, "text": piece, "finish_reason": finish}
    return {"id": "x", "object": "chat.completion.chunk" if chat else "text_completion", "model": MODEL,
            "choices": [choice]}


async def _send(resp: web.StreamResponse, event: dict) -> None:
    await resp.write(f"data: {json.dumps(event)}\n\n".encode())


async def serve(args: argparse.Namespace) -> None:
    runner = web.AppRunner(build_app(args), keepalive_timeout=args.keepalive_s)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", args.port)
    await site.start()
    print(f"PORT {runner.addresses[0][1]}", flush=True)
    await asyncio.Event().wait()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--ttft-ms", type=float, default=200)
    parser.add_argument("--itl-ms", type=float, default=20)
    parser.add_argument("--log", default=None)
    parser.add_argument("--model", default=MODEL, help="the served model's id (a local checkpoint directory, as "
                                                       "a server serving one names it)")
    parser.add_argument("--http-error-on", type=int, default=-1)
    parser.add_argument("--cut-on", type=int, default=-1)
    parser.add_argument("--keepalive-s", type=float, default=75.0)
    asyncio.run(serve(parser.parse_args()))


if __name__ == "__main__":
    main()
