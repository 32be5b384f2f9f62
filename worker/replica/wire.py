"""The one wire between the ingress and a worker replica: plain typed messages.

A request's output comes back on the caller's *delta channel* to its replica: one per (ingress,
replica), carrying every request's deltas of an engine step as one frame, a list of
``RequestOutputDelta`` (and ``Notice``) encoded with msgspec (``encode_batch``). The channel is a
TCP connection from the ingress to the replica where it can connect, else the ``channel`` call's
own Serve stream, which carries the same encoded frames.

A request goes to a replica one of two ways. Through Serve, as a handle call
``generate(WorkerRequest)``: Serve's request router (pagefleet's, reading the request's
``ranking``) places it and Serve's queue counts it; its own stream carries its ``Placed`` first
and its ``Ended`` last, or its error. Or, when its ranking's first replica is one whose channel is
an open connection, as a frame on that connection (``encode_commands``: the request, later maybe
its ``Abort``): a Serve handle call costs several milliseconds before the replica sees it, a frame
a fraction of one. The replica answers such a request on the channel only: its deltas, or a
``Notice`` (refused because the replica is full: the ingress sends it through Serve; or the
error it failed with). Nothing on a connection is pickled: a frame decodes into these types
(``SamplingParams`` checks itself as it decodes) or the connection is dropped.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import NamedTuple

import msgspec

from pagefleet.worker.core.resume import ResumeState
from pagefleet.worker.outputs import RequestOutputDelta
from pagefleet.worker.sampling_params import SamplingParams


@dataclass(slots=True)
class WorkerRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    # The prompt's full-block hashes under ``extra_keys``, packed (16 bytes each), computed once
    # by the ingress: the worker uses them instead of hashing again, the routers route by them.
    block_hashes: bytes = b""
    extra_keys: tuple = ()  # what changes KV content besides tokens: the request's cache salt
    # Replica ids the global scheduler ranked for this request, best first (None: no ranking,
    # the request router decides alone). Read by the request router; the worker ignores it.
    ranking: list[str] | None = None
    # The caller's delta channel on the replica (None: deltas on the request's own stream).
    channel: str | None = None
    # The W3C trace context of the ingress's span of this request (None: not traced).
    trace_headers: dict[str, str] | None = None
    # A sequence continued here after its replica was lost: the engine starts it from this state
    # (``worker.core.resume``; params.n is 1). None: a new request.
    resume: ResumeState | None = None
    # Who sent it (the client's address at the ingress): the worker bounds each client's share
    # of its grammar compile queue by this key.
    client: str = ""
    # vLLM's request priority: lower is served earlier by an engine scheduling by priority.
    priority: int = 0
    # The LoRA adapter the request runs with, by its served name (None: the base model); its
    # block hashes are under it (``block_hash.extra_keys_digest``).
    lora_name: str | None = None
    # Where that adapter is read from: a replica that lacks it (one started after the adapter was
    # loaded at runtime, or that never ran it) registers it from there before the request runs.
    lora_path: str | None = None


@dataclass(slots=True)
class Placed:
    """A channel request's first item: which replica runs it, and whether its deltas arrive on
    that replica's channel (``on_channel``) or follow on this stream (no reader was attached to
    the channel when the request started: the caller's first request there, or a channel that
    could not attach yet because the replica is full)."""

    replica_id: str
    on_channel: bool = True


@dataclass(slots=True)
class Ended:
    """A channel request's last item: the replica put ``num_deltas`` deltas on the channel, the
    last one finished."""

    num_deltas: int


@dataclass(slots=True)
class ChannelOpen:
    """The argument of a replica's ``channel`` call: the request routers send it to ``replica_id``
    and nowhere else; the replica refuses it if it is not that replica."""

    channel_id: str
    replica_id: str
    # Ask for the channel on a TCP connection: the call's one item is then a ``SocketOffer``
    # (False: the call's own stream is the channel).
    socket: bool = False
    # The caller's Ray node: one on the replica's own node is offered a loopback socket.
    node_id: str | None = None


class Abort(NamedTuple):
    """Stop a request sent on the connection (its client went away)."""

    request_id: str


@dataclass(slots=True)
class Notice:
    """The replica's last word on a request sent on the connection, when it is not a finished
    delta: ``kind`` is ``refused`` (the replica holds as many requests as it may; nothing ran),
    ``invalid`` (the engine refused it: ``message``, ``param`` and ``code`` as ``InvalidRequest``
    has them), ``busy`` (its grammar compile was turned away: ``CompileQueueFull``), ``engine_dead`` (the replica's engine died) or ``error`` (anything else)."""

    request_id: str
    kind: str
    message: str = ""
    param: str | None = None
    code: str | None = None


@dataclass(slots=True)
class SocketOffer:
    """Where to connect for a channel, and the one-time token that claims it (the first bytes
    the caller sends; it sends nothing else)."""

    host: str
    port: int
    token: bytes


# Where a replica's channel sockets listen when set (else loopback for callers on the replica's
# node and the node's address for others): the one-node cluster ``pagefleet serve`` starts sets
# loopback, since every caller runs on that node.
CHANNEL_HOST_ENV = "PAGEFLEET_CHANNEL_HOST"
# A frame on a channel connection: this header (the body's length), then the body.
FRAME_HEADER = struct.Struct("!I")
# A frame longer than this is not from a peer of ours: the connection is dropped.
MAX_FRAME_BYTES = 64 << 20

_encoder = msgspec.msgpack.Encoder()
# A delta encodes as an array, a Notice as a map: msgspec tells them apart without a tag, so a
# batch of deltas alone is the same bytes it always was. Likewise an Abort and a WorkerRequest.
_batch_decoder = msgspec.msgpack.Decoder(list[RequestOutputDelta | Notice])
_commands_decoder = msgspec.msgpack.Decoder(list[WorkerRequest | Abort])


def encode_batch(batch: list[RequestOutputDelta | Notice]) -> bytes:
    """One channel item: what the replica put on the channel since the reader last took, oldest first."""
    return _encoder.encode(batch)


def decode_batch(body: bytes | memoryview) -> list[RequestOutputDelta | Notice]:
    """The deltas and notices of one channel item; ``msgspec.ValidationError`` or
    ``msgspec.DecodeError`` for anything else."""
    return _batch_decoder.decode(body)


def encode_frame(batch: list[RequestOutputDelta | Notice]) -> bytes:
    """A channel item as it goes on a connection: header, then body."""
    body = encode_batch(batch)
    return FRAME_HEADER.pack(len(body)) + body


def encode_commands(commands: list[WorkerRequest | Abort]) -> bytes:
    """Requests and aborts as one frame on a channel connection, from the ingress: header, then body."""
    body = _encoder.encode(commands)
    return FRAME_HEADER.pack(len(body)) + body


def decode_commands(body: bytes | memoryview) -> list[WorkerRequest | Abort]:
    """The requests and aborts of one frame from the ingress; ``msgspec.ValidationError`` (a
    request whose ``SamplingParams`` refuse themselves among them) or ``DecodeError`` for anything else."""
    return _commands_decoder.decode(body)
