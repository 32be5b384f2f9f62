"""Process groups of one tensor-parallel group: rendezvous, init, teardown.

Two groups per engine. The *compute* group (NCCL on CUDA, gloo on CPU) carries the
layers' all-reduce and the logits gather; its timeout bounds how long a rank waits for a
peer that hangs. The *control* group (always gloo, CPU tensors) carries rank 0's step
broadcast; ranks 1..N-1 wait on it between steps for as long as the engine is idle, so
their side of it gets a practically unbounded timeout, while rank 0's side keeps the step
timeout (gloo timeouts are local to each process).

One tensor-parallel engine per process at a time: torch.distributed's default group is
process-wide state.
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from pagefleet.worker.parallel.tp_group import TPGroup

logger = logging.getLogger(__name__)

# Ranks 1..N-1 wait on the control group while the engine is idle. Rank 0 exiting
# closes the sockets (and Ray kills its actors), so this never turns into a real hang.
IDLE_WAIT = timedelta(days=365)
LOOPBACK = "127.0.0.1"


def rendezvous_host(rank0_node: str, rank_nodes: list[str], node_ip: str) -> str:
    """Where the group's sockets listen: loopback when every rank runs on rank 0's node (always so
    under STRICT_PACK), so nothing of the group is reachable from the network; else the node's address."""
    return LOOPBACK if all(node == rank0_node for node in rank_nodes) else node_ip


@dataclass(frozen=True, slots=True)
class ProcessGroups:
    tp: TPGroup       # the compute group, as the layers see it
    control: object   # gloo ProcessGroup for step broadcasts from rank 0
    backend: str      # of the compute group: "nccl" or "gloo"


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def create_rendezvous_store(host: str, world_size: int, timeout_s: float) -> dist.TCPStore:
    """Rank 0's TCP store on a free port the OS picks (``store.port``); the other ranks
    join it by address. Not waiting for them here: they connect during init. The store is
    handed a socket already bound to ``host``: left to itself it listens on every interface."""
    listener = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((host, 0))
        listener.listen(128)
        store = dist.TCPStore(host, listener.getsockname()[1], world_size, is_master=True,
                              timeout=timedelta(seconds=timeout_s), wait_for_workers=False,
                              master_listen_fd=listener.detach())
    finally:
        listener.close()
    return store


def init_process_groups(*, rank: int, world_size: int, device: torch.device, host: str, port: int,
                        step_timeout_s: float, store: dist.TCPStore | None = None,
                        init_timeout_s: float = 120.0) -> ProcessGroups:
    """Join the group of ``world_size`` ranks whose store rank 0 serves at host:port.
    Every rank calls this at about the same time; it returns once all have joined."""
    if dist.is_initialized():
        raise RuntimeError("torch.distributed is already initialized in this process: only one "
                           "tensor-parallel engine can live in a process; shut the other one down first")
    if store is None:
        store = dist.TCPStore(host, port, world_size, is_master=False, timeout=timedelta(seconds=init_timeout_s))
    backend = backend_for(device)
    step_timeout = timedelta(seconds=step_timeout_s)
    kwargs = {"device_id": device} if backend == "nccl" else {"pg_options": _gloo_on(host, step_timeout)}
    if backend == "nccl" and host == LOOPBACK:
        os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")  # NCCL's own bootstrap sockets too
    # The default group is the compute group. For NCCL its timeout is set past the step
    # timeout: rank 0 polls the step itself (see TPExecutor) and must notice a dead peer
    # before NCCL's watchdog does, since the watchdog tears the whole process down.
    compute_timeout = step_timeout + timedelta(seconds=30) if backend == "nccl" else step_timeout
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=compute_timeout,
                            **kwargs)
    control_timeout = step_timeout if rank == 0 else IDLE_WAIT
    control = dist.new_group(backend="gloo", timeout=control_timeout, pg_options=_gloo_on(host, control_timeout))
    logger.info("tensor-parallel rank %d/%d joined (%s, rendezvous %s:%d)", rank, world_size, backend, host, port)
    return ProcessGroups(TPGroup(rank, world_size, dist.group.WORLD), control, backend)


def _gloo_on(host: str, timeout: timedelta):
    """Gloo options whose sockets listen on ``host`` (by default gloo binds whatever the machine's
    hostname resolves to, often the node's public address)."""
    options = dist.ProcessGroupGloo._Options()  # torch 2.13 has no public way to pick gloo's address
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    options._timeout = timeout
    return options


def destroy_process_groups(*, abort: bool = False) -> None:
    """Leave the groups so a new engine can init again. ``abort`` first: after a failure
    NCCL kernels may still wait on a dead peer, and only an abort frees them."""
    if not dist.is_initialized():
        return
    if abort and dist.get_backend() == "nccl":
        # Private but the only way to unstick NCCL without killing the process (torch 2.13).
        dist.distributed_c10d._abort_process_group()
        return
    dist.destroy_process_group()
