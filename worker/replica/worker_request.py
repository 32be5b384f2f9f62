"""What the ingress and a worker replica send each other (plain data, crosses Ray).

A request goes to a replica as a ``WorkerRequest``. Without a ``channel`` its Serve stream
carries its deltas, one item per engine step. With one (what the ingress does), the replica
puts its deltas on that ingress's ``channel`` instead (one TCP connection, or one Serve stream,
per (ingress, replica) carrying every request's deltas of a step as one item:
``worker.replica.delta_channel``), and the
request's own stream carries only a ``Placed`` first and an ``Ended`` last, or an error; a
request that starts while no reader is attached to the channel keeps its deltas on its own
stream, after its ``Placed``.

Once its channel is a TCP connection, the ingress sends a request on that connection instead of
through Serve (``worker.replica.delta_channel``): the ``WorkerRequest`` itself, then an ``Abort`` if the
client goes away first; the replica answers on the channel with the request's deltas, or a
``Refused`` (it holds as many requests as it may: the ingress sends it through Serve, which
queues it) or a ``Failed`` with the error.
"""

from __future__ import annotations

from dataclasses import dataclass

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
    the caller sends)."""

    host: str
    port: int
    token: bytes


@dataclass(slots=True)
class Abort:
    """Sent on a channel connection: stop a request sent on it and free its blocks."""

    request_id: str


@dataclass(slots=True)
class Refused:
    """On a channel: the replica did not start a request sent on the connection (it holds as many
    as it may); nothing of it ran."""

    request_id: str


@dataclass(slots=True)
class Failed:
    """On a channel: a request sent on the connection failed with ``error`` (the engine refused
    it, or its engine died)."""

    request_id: str
    error: BaseException
