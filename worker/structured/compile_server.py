"""The grammar compile server: a small process that forks one child per compile.

``CompilePool`` starts it as ``python -m pagefleet.worker.structured.compile_server``, not through
``multiprocessing``: a Ray worker's ``__main__`` would be imported again in every spawned child.
It imports xgrammar and builds the compiler once, then forks a child for each compile, so a
compile starts in milliseconds and killing it (``cancel``) stops that work and nothing else.
Every process here runs at a lower CPU priority than the engine (``os.nice``).

Frames on stdin/stdout: a 4-byte length, then a msgpack array. In: first the tokenizer info
(xgrammar's JSON), then ``["compile", job_id, kind, spec]`` and ``["cancel", job_id]``. Out:
``["ready"]`` once the compiler is built, ``["started", job_id, pid]``, and ``["done", job_id,
outcome, text]`` once the child is gone: outcome ``ok`` (text: the compiled grammar's JSON),
``refused`` (xgrammar's message), ``empty`` (the grammar allows no first token: its language is
empty) or ``ended`` (the child died: killed, or crashed).
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import struct
import sys
from typing import BinaryIO

import msgspec

from pagefleet.worker.structured.json_schema import JSON_MAX_WHITESPACE, length_bounds_as_patterns

FRAME_HEADER = struct.Struct("!I")
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder()


def write_frame(out: BinaryIO, message) -> None:
    body = _encoder.encode(message)
    out.write(FRAME_HEADER.pack(len(body)) + body)
    out.flush()


def read_frame(stream: BinaryIO):
    """The next message, or None at the end of the stream."""
    header = stream.read(FRAME_HEADER.size)
    if len(header) < FRAME_HEADER.size:
        return None
    (size,) = FRAME_HEADER.unpack(header)
    body = stream.read(size)
    if len(body) < size:
        return None
    return _decoder.decode(body)


def compile_spec(compiler, vocab_size: int, kind: str, spec: str) -> tuple[str, str]:
    """(outcome, text) of compiling one spec: in the forked child."""
    import xgrammar as xgr

    try:
        if kind in ("json", "json_object"):
            schema = json.loads(spec) if kind == "json" else {"type": "object"}
            compiled = compiler.compile_json_schema(json.dumps(length_bounds_as_patterns(schema)),
                                                    max_whitespace_cnt=JSON_MAX_WHITESPACE)
        elif kind == "regex":
            compiled = compiler.compile_regex(spec)
        else:
            compiled = compiler.compile_grammar(spec)
    except Exception as e:
        return "refused", str(e).strip() or type(e).__name__
    # A grammar whose first step allows no token, not even a stop token, has an empty language:
    # no output can satisfy it, and a row masked to nothing has nothing to sample.
    bitmask = xgr.allocate_token_bitmask(1, vocab_size)
    xgr.GrammarMatcher(compiled).fill_next_token_bitmask(bitmask)
    if not bool(bitmask.any()):
        return "empty", ""
    return "ok", compiled.serialize_json()


def _run_child(compiler, vocab_size: int, kind: str, spec: str, result_fd: int) -> None:
    try:
        outcome, text = compile_spec(compiler, vocab_size, kind, spec)
        with os.fdopen(result_fd, "wb") as out:
            write_frame(out, [outcome, text])
    finally:
        os._exit(0)


def _frames(buffer: bytearray) -> list:
    """The whole messages at the front of ``buffer``, taken out of it."""
    messages = []
    while len(buffer) >= FRAME_HEADER.size:
        (size,) = FRAME_HEADER.unpack_from(buffer)
        if len(buffer) < FRAME_HEADER.size + size:
            break
        messages.append(_decoder.decode(bytes(buffer[FRAME_HEADER.size:FRAME_HEADER.size + size])))
        del buffer[:FRAME_HEADER.size + size]
    return messages


def serve(stdin: BinaryIO, stdout: BinaryIO) -> None:
    import xgrammar as xgr

    info_json = read_frame(stdin)
    if info_json is None:
        return
    info = xgr.TokenizerInfo.deserialize_json(info_json)
    # One thread in each child, and no cache: GrammarCache is the one cache, in the parent.
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    write_frame(stdout, ["ready"])
    in_fd = stdin.fileno()  # read raw from here on: a buffered reader would hide frames from select
    pending = bytearray()
    children: dict[int, tuple[int, int, bytearray]] = {}  # result fd -> (job id, pid, bytes read)
    pids: dict[int, int] = {}  # job id -> pid
    sel = selectors.DefaultSelector()
    sel.register(in_fd, selectors.EVENT_READ)
    while True:
        for key, _ in sel.select():
            fd = key.fileobj
            chunk = os.read(fd, 1 << 20)
            if fd == in_fd:
                if not chunk:  # the parent is gone: so are its compiles
                    for pid in pids.values():
                        os.kill(pid, signal.SIGKILL)
                    return
                pending += chunk
                for message in _frames(pending):
                    if message[0] == "compile":
                        _start(compiler, info.vocab_size, message, children, pids, sel, stdout)
                    elif message[0] == "cancel" and message[1] in pids:
                        os.kill(pids[message[1]], signal.SIGKILL)
                continue
            job_id, pid, data = children[fd]
            if chunk:
                data += chunk
                continue
            sel.unregister(fd)
            os.close(fd)
            del children[fd], pids[job_id]
            os.waitpid(pid, 0)  # reaped before the parent hears of it: the process is gone
            results = _frames(data)
            outcome, text = results[0] if results else ("ended", "")
            write_frame(stdout, ["done", job_id, outcome, text])


def _start(compiler, vocab_size: int, message: list, children: dict, pids: dict, sel, stdout: BinaryIO) -> None:
    _, job_id, kind, spec = message
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        _run_child(compiler, vocab_size, kind, spec, w)
    os.close(w)
    children[r] = (job_id, pid, bytearray())
    pids[job_id] = pid
    sel.register(r, selectors.EVENT_READ)
    write_frame(stdout, ["started", job_id, pid])


def main() -> None:
    os.nice(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
    serve(sys.stdin.buffer, sys.stdout.buffer)


if __name__ == "__main__":
    main()
