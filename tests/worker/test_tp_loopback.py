"""The tensor-parallel group listens on loopback when its ranks share a node: no socket of the
rendezvous store or of gloo is reachable from the network."""

from __future__ import annotations

import os
import socket
import struct

import pytest
import torch.multiprocessing as mp

from pagefleet.worker.parallel.distributed import LOOPBACK, rendezvous_host


def test_rendezvous_host_is_loopback_on_one_node():
    assert rendezvous_host("n1", ["n1", "n1", "n1"], "10.0.0.5") == LOOPBACK
    assert rendezvous_host("n1", ["n1", "n2"], "10.0.0.5") == "10.0.0.5"
    assert rendezvous_host("n1", [], "10.0.0.5") == LOOPBACK


def _tcp_sockets() -> list[tuple[str, str]]:
    """(local ip, state) of every IPv4/IPv6 TCP socket this process holds, from /proc."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for table, family in (("/proc/self/net/tcp", socket.AF_INET), ("/proc/self/net/tcp6", socket.AF_INET6)):
        with open(table) as f:
            next(f)
            for line in f:
                fields = line.split()
                if fields[9] not in inodes:
                    continue
                raw = bytes.fromhex(fields[1].split(":")[0])
                # /proc prints each 32-bit word in host (little-endian) order
                words = b"".join(struct.pack("<I", struct.unpack(">I", raw[i:i + 4])[0])
                                 for i in range(0, len(raw), 4))
                ip = socket.inet_ntop(family, words)
                found.append((ip.removeprefix("::ffff:"), {"0A": "LISTEN", "01": "ESTABLISHED"}.get(fields[3],
                                                                                                   fields[3])))
    return found


def _rank(rank: int, port: int, results) -> None:
    import torch
    import torch.distributed as dist

    from pagefleet.worker.parallel.distributed import (
        create_rendezvous_store,
        destroy_process_groups,
        init_process_groups,
    )

    store = create_rendezvous_store(LOOPBACK, 2, 60) if rank == 0 else None
    if rank == 0:
        results.put(("port", store.port))
    else:
        port = results.get(timeout=60)
    groups = init_process_groups(rank=rank, world_size=2, device=torch.device("cpu"), host=LOOPBACK,
                                 port=store.port if store else port, step_timeout_s=60, store=store)
    x = torch.ones(4)
    dist.all_reduce(x)
    dist.broadcast(torch.zeros(2), src=0, group=groups.control)
    results.put((rank, x.tolist(), _tcp_sockets()))
    dist.barrier()
    destroy_process_groups()


@pytest.mark.skipif(not os.path.exists("/proc/self/net/tcp"), reason="needs Linux /proc")
def test_store_and_gloo_sockets_are_all_on_loopback():
    ctx = mp.get_context("spawn")
    to_rank1, results = ctx.Queue(), ctx.Queue()
    rank0 = ctx.Process(target=_rank, args=(0, 0, results))
    rank0.start()
    kind, port = results.get(timeout=120)
    assert kind == "port"
    rank1 = ctx.Process(target=_rank, args=(1, port, to_rank1))
    to_rank1.put(port)
    rank1.start()
    reports = [results.get(timeout=120), to_rank1.get(timeout=120)]
    rank0.join(60)
    rank1.join(60)
    for rank, reduced, sockets in reports:
        assert reduced == [2.0] * 4  # the group works
        assert any(state == "LISTEN" for _, state in sockets)  # rank 0's store, each rank's gloo pairs
        assert {ip for ip, _ in sockets} == {LOOPBACK}, (rank, sockets)
