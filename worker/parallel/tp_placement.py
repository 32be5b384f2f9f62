"""Where the tensor-parallel ranks run: a local Ray, and a STRICT_PACK placement group
with one bundle per rank (bundle i for rank i).

Inside Serve the worker replica already sits in bundle 0 of its own placement group and
the ranks 1..N-1 take bundles 1..N-1 of it. Anywhere else (offline ``LLM``) the engine
creates the group on its own node; on CUDA a small actor holds bundle 0's GPU so that
rank 0, which is not a Ray actor, learns which GPU is its own and no actor shares it.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

logger = logging.getLogger(__name__)


def ensure_ray(min_cpus: int) -> None:
    """Join the local Ray cluster if one runs (or RAY_ADDRESS names one), else start one
    with at least ``min_cpus`` logical CPUs so every rank's bundle fits."""
    if ray.is_initialized():
        return
    try:
        ray.init(address="auto", log_to_driver=True)
    except ConnectionError:
        ray.init(num_cpus=max(os.cpu_count() or 1, min_cpus), include_dashboard=False, log_to_driver=True)


@ray.remote(num_cpus=0)
class _GpuReservation:
    """Holds bundle 0's GPU for rank 0 (the engine's own process) while the engine lives."""

    def gpu_ids(self) -> list[str]:
        return [str(i) for i in ray.get_gpu_ids()]


@dataclass(slots=True)
class Placement:
    group: PlacementGroup
    owned: bool                             # created here, so removed here
    rank0_cuda_index: int | None = None     # local CUDA index rank 0 must use, when chosen here
    reservation: object | None = None       # _GpuReservation handle, when one holds bundle 0
    bundle_specs: list[dict] = field(default_factory=list)

    def strategy(self, rank: int) -> PlacementGroupSchedulingStrategy:
        return PlacementGroupSchedulingStrategy(placement_group=self.group, placement_group_bundle_index=rank,
                                                placement_group_capture_child_tasks=False)

    def actor_resources(self, rank: int, use_cuda: bool) -> dict:
        spec = self.bundle_specs[rank]
        if use_cuda and spec.get("GPU", 0) < 1:
            raise ValueError(f"placement group bundle {rank} is {spec}: tensor-parallel rank {rank} needs one GPU")
        return {"num_cpus": min(1.0, spec.get("CPU", 0)), "num_gpus": 1 if use_cuda else 0}

    def release(self) -> None:
        if self.reservation is not None:
            ray.kill(self.reservation, no_restart=True)
            self.reservation = None
        if self.owned:
            remove_placement_group(self.group)
            self.owned = False


def acquire_placement(tp_size: int, use_cuda: bool, timeout_s: float) -> Placement:
    current = ray.util.get_current_placement_group()
    if current is not None:
        specs = current.bundle_specs
        if len(specs) < tp_size:
            raise ValueError(f"this replica's placement group has {len(specs)} bundles; tensor_parallel_size "
                             f"{tp_size} needs one per rank (bundle 0 for the replica itself, STRICT_PACK)")
        return Placement(current, owned=False, bundle_specs=specs)
    holds_gpu = use_cuda and bool(ray.get_gpu_ids())  # a Ray task/actor that already owns its GPU
    rank_bundle = {"GPU": 1, "CPU": 1} if use_cuda else {"CPU": 1}
    # Rank 0 is this process: pin the group to this node, and reserve rank 0's share.
    first = {"CPU": 1} if holds_gpu else dict(rank_bundle)
    first[f"node:{ray.util.get_node_ip_address()}"] = 0.001
    specs = [first] + [dict(rank_bundle) for _ in range(tp_size - 1)]
    group = placement_group(specs, strategy="STRICT_PACK", name=f"pagefleet-tp-{os.getpid()}")
    placement = Placement(group, owned=True, bundle_specs=specs)
    try:
        _await_group_and_rank0_gpu(placement, tp_size, use_cuda and not holds_gpu, rank_bundle, timeout_s)
    except BaseException:
        placement.release()  # nothing else holds it yet: an error here must not strand N GPUs
        raise
    return placement


def _await_group_and_rank0_gpu(placement: Placement, tp_size: int, reserve_gpu: bool, rank_bundle: dict,
                               timeout_s: float) -> None:
    try:
        ray.get(placement.group.ready(), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        raise RuntimeError(f"could not place {tp_size} tensor-parallel bundles {rank_bundle} on one node within "
                           f"{timeout_s:.0f} s; available: {ray.available_resources()}") from None
    if not reserve_gpu:
        return
    placement.reservation = _GpuReservation.options(num_gpus=1, scheduling_strategy=placement.strategy(0)).remote()
    gpu = ray.get(placement.reservation.gpu_ids.remote(), timeout=timeout_s)[0]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = visible.split(",") if visible else None
    if ids is not None and gpu not in ids:
        raise RuntimeError(f"Ray gave rank 0 GPU {gpu}, which this process cannot see "
                           f"(CUDA_VISIBLE_DEVICES={visible})")
    placement.rank0_cuda_index = ids.index(gpu) if ids is not None else int(gpu)
