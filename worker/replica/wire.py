"""The one wire between the ingress and a worker replica: plain typed messages.

A request goes to a replica as a Serve handle call, ``generate(WorkerRequest)``, so that Serve's
request router (pagefleet's, reading the request's ``ranking``) places it and Serve's queue and
graceful shutdown count it. Its output comes back on the caller's *delta channel* to that replica:
one per (ingress, replica), carrying every request's deltas of an engine step as one frame, a
``list[RequestOutputDelta]`` encoded with msgspec (``encode_batch``). The channel is a TCP
connection from the ingress to the replica where it can connect, else the ``channel`` call's own
Serve stream, which carries the same encoded frames. Nothing on the connection is pickled: a frame
decodes into these types or is refused. A request's own stream carries its ``Placed`` first and
its ``Ended`` last, or its error.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

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


@dataclass(slots=True)
class SocketOffer:
    """Where to connect for a channel, and the one-time token that claims it (the first bytes
    the caller sends; it sends nothing else)."""

    host: str
    port: int
    token: bytes


# Where a replica's channel sockets listen when set (else the node's address): the one-node
# cluster ``pagefleet serve`` starts sets loopback, since every caller runs on that node.
CHANNEL_HOST_ENV = "PAGEFLEET_CHANNEL_HOST"
# A frame on a channel connection: this header (the body's length), then the body.
FRAME_HEADER = struct.Struct("!I")
# A frame longer than this is not from a peer of ours: the connection is dropped.
MAX_FRAME_BYTES = 64 << 20

_encoder = msgspec.msgpack.Encoder()
_batch_decoder = msgspec.msgpack.Decoder(list[RequestOutputDelta])


def encode_batch(batch: list[RequestOutputDelta]) -> bytes:
    """One channel item: the deltas the engine produced since the reader last took, oldest first."""
    return _encoder.encode(batch)


def decode_batch(body: bytes | memoryview) -> list[RequestOutputDelta]:
    """The deltas of one channel item; ``msgspec.ValidationError`` or ``msgspec.DecodeError``
    for anything else."""
    return _batch_decoder.decode(body)


def encode_frame(batch: list[RequestOutputDelta]) -> bytes:
    """A channel item as it goes on a connection: header, then body."""
    body = encode_batch(batch)
    return FRAME_HEADER.pack(len(body)) + body
