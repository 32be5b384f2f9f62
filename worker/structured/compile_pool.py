"""Grammar compiles as bounded work: each in a process of its own that is killed at the time limit.

A compile can take seconds to minutes on a large vocabulary (a bounded repetition in a pattern),
and xgrammar cannot be interrupted: so each runs in a child of the compile server
(``compile_server``), at a lower CPU priority than the engine, and is killed (SIGKILL) when its
time is up or nobody may wait for it. The queue in front is bounded per client and in all: a
full one refuses at once (``CompileQueueFull``, a 429 at the ingress) instead of growing.

Two lanes keep a cheap compile from waiting behind an expensive one. Every compile starts in one
of ``quick_slots``; one still running after ``quick_s`` moves to one of ``long_slots``, freeing its
quick slot for the queue, or is killed and refused if the long lane is full. Cost cannot be told
from a spec's size (a 71-byte schema can take a minute), only from running it, so the lane is
picked by the time a compile has taken. At most ``quick_slots + long_slots`` processes compile.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

from pagefleet.worker.errors import CompileQueueFull
from pagefleet.worker.structured.compile_server import read_frame, write_frame

COMPILE_TIMEOUT_S = 10.0
QUICK_COMPILE_S = 1.0
QUICK_SLOTS = 2
LONG_SLOTS = 1
MAX_QUEUED_COMPILES = 32
MAX_COMPILES_PER_CLIENT = 4
COMPILE_NICENESS = 10
# Importing xgrammar (and torch under it) takes seconds on a busy machine: the server's start is
# not counted against a compile's time limit, but a server that never says it is ready fails it.
SERVER_START_TIMEOUT_S = 120.0


class CompileRefused(Exception):
    """xgrammar refused the spec (its message), or its process died."""


class EmptyLanguage(Exception):
    """The grammar allows no first token, not even a stop token: no output satisfies it."""


class CompileTimeout(Exception):
    """The compile did not finish (or start) within the time limit; its process was killed.
    ``queued``: it never started, the queue ahead of it was too long (worth retrying)."""

    def __init__(self, queued: bool) -> None:
        super().__init__("queued" if queued else "compiling")
        self.queued = queued


@dataclass(slots=True)
class _Job:
    job_id: int
    kind: str
    spec: str
    client: str
    decode: Callable[[str], object]
    future: Future
    queued_at: float
    started_at: float | None = None
    pid: int | None = None
    long: bool = False


class CompilePool:
    """``tokenizer_info``: xgrammar's TokenizerInfo as JSON, asked for once, when the compile
    server starts (at the first compile, not before: most engines never compile a grammar)."""

    def __init__(self, tokenizer_info: Callable[[], str], *, timeout_s: float = COMPILE_TIMEOUT_S,
                 quick_s: float = QUICK_COMPILE_S, quick_slots: int = QUICK_SLOTS, long_slots: int = LONG_SLOTS,
                 max_queued: int = MAX_QUEUED_COMPILES, max_per_client: int = MAX_COMPILES_PER_CLIENT,
                 niceness: int = COMPILE_NICENESS) -> None:
        self.timeout_s, self.quick_s = timeout_s, quick_s
        self.quick_slots, self.long_slots = quick_slots, long_slots
        self.max_queued, self.max_per_client = max_queued, max_per_client
        self._niceness = niceness
        self._tokenizer_info = tokenizer_info
        self._cond = threading.Condition()
        # Queued compiles by client, taken in turn: one client's backlog does not hold up another's.
        self._queues: OrderedDict[str, deque[_Job]] = OrderedDict()
        self._num_queued = 0
        self._running: dict[int, _Job] = {}
        self._per_client: dict[str, int] = {}
        self._next_id = 0
        self._server: subprocess.Popen | None = None
        self._ready_at: float | None = None
        self._started_at = 0.0
        self._closed = False
        self._scheduler = threading.Thread(target=self._schedule, name="pagefleet-grammar", daemon=True)
        self._scheduler.start()

    def submit(self, kind: str, spec: str, client: str, decode: Callable[[str], object]) -> Future:
        """A future of ``decode(compiled grammar's JSON)``; it fails with CompileRefused,
        EmptyLanguage or CompileTimeout. Raises CompileQueueFull at once when the queue is full."""
        with self._cond:
            if self._closed:
                raise RuntimeError("the compile pool is shut down")
            if self._per_client.get(client, 0) >= self.max_per_client:
                raise CompileQueueFull(f"this client has {self.max_per_client} grammars compiling or queued, "
                                       "the most it may")
            if self._num_queued >= self.max_queued:
                raise CompileQueueFull(f"{self.max_queued} grammars are queued to compile, the most there may be")
            job = _Job(self._next_id, kind, spec, client, decode, Future(), time.monotonic())
            self._next_id += 1
            self._per_client[client] = self._per_client.get(client, 0) + 1
            self._queues.setdefault(client, deque()).append(job)
            self._num_queued += 1
            self._cond.notify_all()
            return job.future

    def running_pids(self) -> list[int]:
        """The processes compiling now."""
        with self._cond:
            return [j.pid for j in self._running.values() if j.pid is not None]

    def shutdown(self) -> None:
        with self._cond:
            self._closed = True
            for job in [*(j for q in self._queues.values() for j in q), *self._running.values()]:
                job.future.set_exception(RuntimeError("the compile pool is shut down"))
            self._queues.clear()
            self._running.clear()
            self._cond.notify_all()
        self._scheduler.join(timeout=5)

    # ---- the scheduler thread ---------------------------------------------------------------

    def _schedule(self) -> None:
        with self._cond:
            while not self._closed:
                if self._server is None and (self._queues or self._running):
                    try:
                        self._start_server()
                    except Exception as e:
                        self._fail_queue(CompileRefused(f"the compile server did not start: {e}"))
                    continue
                if self._ready_at is not None:
                    wake = self._step(time.monotonic())
                elif self._server is None:
                    wake = None  # idle, no server: until a compile is submitted (it notifies)
                elif time.monotonic() - self._started_at > SERVER_START_TIMEOUT_S:
                    self._stop_server()
                    self._fail_queue(CompileRefused("the compile server did not start in time"))
                    continue
                else:
                    wake = self._started_at + SERVER_START_TIMEOUT_S - time.monotonic() + 0.01
                self._cond.wait(wake)
            if self._server is not None:
                self._stop_server()

    def _step(self, now: float) -> float | None:
        """Time out, promote or kill running compiles, start queued ones; seconds until the next
        deadline (None: none)."""
        deadlines = []
        for job in list(self._running.values()):
            ran = now - job.started_at
            if ran >= self.timeout_s:
                self._kill(job, CompileTimeout(queued=False))
            elif not job.long and ran >= self.quick_s:
                if sum(j.long for j in self._running.values()) < self.long_slots:
                    job.long = True
                    deadlines.append(job.started_at + self.timeout_s)
                else:
                    self._kill(job, CompileQueueFull(
                        f"the grammar took over {self.quick_s:g} s to compile while the {self.long_slots} "
                        "slots for long compiles were taken"))
            else:
                deadlines.append(job.started_at + (self.timeout_s if job.long else self.quick_s))
        for client in list(self._queues):
            queue = self._queues[client]
            while queue and now - max(queue[0].queued_at, self._ready_at) >= self.timeout_s:
                self._num_queued -= 1
                self._finish(queue.popleft(), error=CompileTimeout(queued=True))
            if not queue:
                del self._queues[client]
        while self._queues:
            job = next(iter(self._queues.values()))[0]
            if sum(not j.long for j in self._running.values()) < self.quick_slots:
                self._take(job.client)
                job.started_at = now
                self._running[job.job_id] = job
                self._send(["compile", job.job_id, job.kind, job.spec])
                deadlines.append(now + self.quick_s)
            else:
                deadlines += [max(q[0].queued_at, self._ready_at) + self.timeout_s for q in self._queues.values()]
                break
        return max(0.0, min(deadlines) - now) if deadlines else None

    def _take(self, client: str) -> _Job:
        """The first queued job of ``client``, whose turn then passes to the next client."""
        queue = self._queues.pop(client)
        job = queue.popleft()
        if queue:
            self._queues[client] = queue
        self._num_queued -= 1
        return job

    def _kill(self, job: _Job, error: Exception) -> None:
        del self._running[job.job_id]
        self._send(["cancel", job.job_id])
        self._finish(job, error=error)

    def _send(self, message: list) -> None:
        try:
            write_frame(self._server.stdin, message)
        except OSError:  # the server died: its reader fails what ran there
            pass

    def _fail_queue(self, error: Exception) -> None:
        while self._queues:
            self._finish(self._take(next(iter(self._queues))), error=error)

    def _finish(self, job: _Job, text: str | None = None, error: Exception | None = None) -> None:
        # Under the lock. decode runs here too: what it records is in place before a waiter wakes.
        self._per_client[job.client] -= 1
        if not self._per_client[job.client]:
            del self._per_client[job.client]
        if error is None:
            try:
                job.future.set_result(job.decode(text))
            except Exception as e:
                job.future.set_exception(e)
        else:
            job.future.set_exception(error)

    def _start_server(self) -> None:
        # Under the lock, released while the tokenizer's vocabulary is read (slow on a large one).
        self._cond.release()
        try:
            info = self._tokenizer_info()
            server = subprocess.Popen([sys.executable, "-m", "pagefleet.worker.structured.compile_server",
                                       str(self._niceness)], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
            write_frame(server.stdin, info)
        finally:
            self._cond.acquire()
        self._server, self._started_at = server, time.monotonic()
        threading.Thread(target=self._read, args=(server,), name="pagefleet-grammar-reader", daemon=True).start()

    def _stop_server(self) -> None:
        server, self._server = self._server, None
        server.stdin.close()  # the server kills its children and exits
        try:
            server.wait(timeout=5)
        except subprocess.TimeoutExpired:
            server.kill()

    # ---- the reader thread ------------------------------------------------------------------

    def _read(self, server: subprocess.Popen) -> None:
        while (message := read_frame(server.stdout)) is not None:
            with self._cond:
                if message[0] == "ready":
                    self._ready_at = time.monotonic()
                elif message[0] == "started" and message[1] in self._running:
                    self._running[message[1]].pid = message[2]
                elif message[0] == "done" and message[1] in self._running:
                    job = self._running.pop(message[1])
                    outcome, text = message[2], message[3]
                    if outcome == "ok":
                        self._finish(job, text)
                    else:
                        self._finish(job, error=EmptyLanguage() if outcome == "empty" else CompileRefused(
                            text or "the compile process ended before the grammar compiled"))
                self._cond.notify_all()
        with self._cond:  # the server died (or was stopped): what ran on it failed; a new one starts
            if self._server is server:
                for job in list(self._running.values()):
                    self._finish(job, error=CompileRefused("the compile server ended"))
                self._running.clear()
                if self._ready_at is None:  # it never started: do not start it again for the same queue
                    self._fail_queue(CompileRefused("the compile server ended before it was ready"))
                self._server, self._ready_at = None, None
                self._cond.notify_all()
