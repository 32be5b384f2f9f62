"""What a delta channel costs per item: on a Serve stream against on a TCP connection.

One sender replica (a ``WorkerReplica`` without an engine: its ``channel`` call and channel socket)
and one receiver replica (a ``ChannelMux``, as the ingress holds it), on a local Ray cluster in
Serve's high-throughput mode, as ``pagefleet serve`` starts it. The receiver places one request
on the sender, whose channel it then reads either on the ``channel`` call's own Serve stream or
on the socket that call offers; the sender puts ``--items`` deltas on the channel, one every
``--pace-ms`` (each its own item, as one stream's tokens at the engine's decode pace). Prints
one JSON line per (transport, round): CPU per item of this process and every process it
started (sender, receiver, Ray's processes, all together; at a slow pace their idle CPU counts
too), the receiver's own, and the wall time per item (``batches``: the items that carried the
deltas; back to back, a reader that falls behind takes several deltas as one).

    python benchmarks/delta_transport.py --items 600 --pace-ms 5 --rounds 2
    python benchmarks/delta_transport.py --items 200 --pace-ms 20 --rounds 2
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from types import SimpleNamespace

import ray
from ray import serve

from pagefleet.cluster.serve_env import fast_path_env, raylet_env
from pagefleet.router.worker_client.delta_mux import ChannelMux
from pagefleet.worker.engine_args import EngineArgs
from pagefleet.worker.outputs import CompletionOutput, RequestOutputDelta
from pagefleet.worker.replica.deployment import WorkerReplica

from _proc_cpu import tree_cpu_s

REQUEST = "r0"


def _delta(k: int) -> RequestOutputDelta:
    return RequestOutputDelta(REQUEST, [CompletionOutput(0, " tok", [k], None, None)], 256, 0, False)


class _NoEngine:
    """The sender replica computes nothing: the test puts the deltas on the channel itself."""

    model_config = SimpleNamespace(served_model_name="delta-transport", max_model_len=0)

    def check_health(self) -> None:  # Serve's health probe reaches it
        pass

    def shutdown(self) -> None:
        pass


@serve.deployment(max_ongoing_requests=8)
class Sender(WorkerReplica):
    """A worker replica (its real ``channel`` call, channels and channel socket) without an engine."""

    def __init__(self) -> None:
        super().__init__(EngineArgs(), engine_factory=lambda args: _NoEngine())

    async def whoami(self) -> str:
        return self.replica_id

    async def attached(self, channel_id: str) -> bool:
        return channel_id in self._channels and self._channels[channel_id].attached

    async def produce(self, channel_id: str, n: int, pace_s: float) -> None:
        channel = self._channel(channel_id)
        channel.requests += 1  # as a running request does: the channel stays open
        try:
            for k in range(n):
                channel.put(_delta(k))
                await asyncio.sleep(pace_s)
        finally:
            channel.requests -= 1


@serve.deployment
class Receiver:
    def __init__(self, sender) -> None:
        self.sender = sender

    async def run(self, sockets: bool, n: int, pace_s: float) -> tuple[int, float, float, dict]:
        mux = ChannelMux(self.sender.options(method_name="channel", stream=True).remote, sockets=sockets)
        q = mux.register(REQUEST)
        mux.placed(REQUEST, await self.sender.whoami.remote())
        while not await self.sender.attached.remote(mux.channel_id):
            await asyncio.sleep(0.01)
        wall, cpu = time.perf_counter(), time.process_time()
        producing = self.sender.produce.remote(mux.channel_id, n, pace_s)
        got = 0
        while got < n:
            await q.get()
            got += 1
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        await producing
        mux.release(REQUEST)
        counters = {"batches": mux.counters.batches, "channels_opened": mux.counters.channels_opened,
                    "socket_channels": mux.counters.socket_channels}
        for task in list(mux._readers.values()):
            task.cancel()
        return got, wall, cpu, counters


def _machine_cpu_s() -> float:
    """This process and everything it started: Ray's processes and both replicas."""
    return sum(tree_cpu_s(os.getpid()).values())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--items", type=int, default=2000)
    ap.add_argument("--pace-ms", type=float, default=5.0,
                    help="between items (0: back to back, where a reader that falls behind takes many as one)")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    with raylet_env(fast_path_env(local=True)):
        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        handle = serve.run(Receiver.bind(Sender.bind()), name="delta-transport", route_prefix=None)
        handle.run.remote(True, 50, 0.0).result()  # warm both paths
        handle.run.remote(False, 50, 0.0).result()
        for round_ in range(1, args.rounds + 1):
            for transport, sockets in (("serve_stream", False), ("socket", True)):
                before = _machine_cpu_s()
                got, wall, cpu, counters = handle.run.remote(sockets, args.items, args.pace_ms / 1000).result()
                machine = _machine_cpu_s() - before
                print(json.dumps({
                    "transport": transport, "round": round_, "items": got, "pace_ms": args.pace_ms,
                    "machine_cpu_us_per_item": round(machine / got * 1e6, 1),
                    "receiver_cpu_us_per_item": round(cpu / got * 1e6, 1),
                    "wall_us_per_item": round(wall / got * 1e6, 1), **counters,
                    "cores": os.cpu_count(), "load_1m": round(os.getloadavg()[0], 2)}), flush=True)
    finally:
        serve.shutdown()
        ray.shutdown()


if __name__ == "__main__":
    main()
