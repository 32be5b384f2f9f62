"""Ray Serve autoscaling over the requests in each worker's engine, however they arrived.

Serve's default policy counts the requests its handles send a deployment. Most of a worker's
requests come on the delta channel's connection instead (``worker.replica.wire``), which Serve
never sees, while each caller's channel is one Serve call that lasts; so its count says little
about the load. Each replica therefore reports its own count (``WorkerReplica.record_autoscaling_stats``,
Ray's custom autoscaling metrics), and ``requests_in_engines_policy`` scales on it the way the
default policy scales on Serve's: replicas = requests / ``target_ongoing_requests``. Serve wraps a
custom policy in the config's bounds, delays and scaling factors, so those keep their meaning.

``kv_room_policy`` (``autoscaling_policy: kv``) also scales on the blocks each engine's running
sequences hold (each replica reports them too): up before the fleet's KV cache runs short (a
request that finds no room waits in the engine's queue, and its TTFT grows), down only as far as
the replicas left would still have room, with a gap between the two shares so that a step down
does not call for a step back up.

This module is pickled by value into Serve's controller (a custom policy's module is), so it
imports nothing of pagefleet's and nothing heavy.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

# The custom metric each replica reports: requests in its engine plus Serve calls waiting there
# for a seat (``Seats.demand``).
LOAD_METRIC = "pagefleet_requests"
# The KV blocks its running sequences hold (cached blocks nobody runs on count as free), and all.
KV_USED_METRIC = "pagefleet_kv_used_blocks"
KV_TOTAL_METRIC = "pagefleet_kv_total_blocks"
POLICY_FUNCTION = "pagefleet.worker.replica.autoscaling:requests_in_engines_policy"
KV_POLICY_FUNCTION = "pagefleet.worker.replica.autoscaling:kv_room_policy"
AUTOSCALING_POLICIES = {"requests": POLICY_FUNCTION, "kv": KV_POLICY_FUNCTION}
# kv_room_policy: more replicas once the fleet's running sequences would hold more than this share
# of its blocks (the rest is the room a burst's prompts take before the new replicas start) ...
KV_UP_SHARE = 0.8
# ... and fewer only while the replicas left would hold at most this share: below KV_UP_SHARE, so
# the step down does not call for a step back up, with room for the load to move between the two.
KV_DOWN_SHARE = 0.6
# Of an engine's batch (max_num_seqs), the share a replica is kept near: decode throughput grows
# until the batch is full, but at a full batch a burst waits in the engine's queue for the whole
# upscale delay and a replica's start. A quarter of the batch is the headroom that absorbs it.
TARGET_BATCH_SHARE = 0.75


def default_target_ongoing_requests(max_num_seqs: int) -> float:
    return float(max(1, math.ceil(TARGET_BATCH_SHARE * max_num_seqs)))


def worker_autoscaling_config(min_replicas: int, max_replicas: int, target_ongoing_requests: float,
                              upscale_delay_s: float, downscale_delay_s: float,
                              extra: Mapping[str, Any] | None = None, policy: str = "requests") -> dict[str, Any]:
    """Serve's ``autoscaling_config`` for the worker deployment, with this module's ``policy``
    (a key of ``AUTOSCALING_POLICIES``); ``extra``: more of Serve's keys (``look_back_period_s``, ...)."""
    if policy not in AUTOSCALING_POLICIES:
        raise ValueError(f"autoscaling_policy must be one of {sorted(AUTOSCALING_POLICIES)}, got {policy!r}")
    if not 1 <= min_replicas <= max_replicas:
        raise ValueError(f"autoscaling needs 1 <= min_replicas <= max_replicas, got {min_replicas}:{max_replicas} "
                         "(a worker replica must stay: the ingress holds requests for one, not for none)")
    if target_ongoing_requests <= 0:
        raise ValueError(f"target_ongoing_requests must be > 0, got {target_ongoing_requests}")
    if upscale_delay_s < 0 or downscale_delay_s < 0:
        raise ValueError("upscale_delay_s and downscale_delay_s must be >= 0")
    ours = {"min_replicas", "max_replicas", "target_ongoing_requests", "upscale_delay_s", "downscale_delay_s",
            "policy"}
    clash = sorted(ours & set(extra or {}))
    if clash:
        raise ValueError(f"autoscaling_config may not set {clash}: they come from workers, "
                         "target_ongoing_requests, upscale_delay_s and downscale_delay_s")
    return {"min_replicas": min_replicas, "max_replicas": max_replicas,
            "target_ongoing_requests": target_ongoing_requests,
            "upscale_delay_s": upscale_delay_s, "downscale_delay_s": downscale_delay_s,
            **dict(extra or {}), "policy": {"policy_function": AUTOSCALING_POLICIES[policy]}}


def requests_in_engines_policy(ctx: Any) -> tuple[float, dict[str, Any]]:
    """Serve's ``AutoscalingContext`` -> (replicas wanted, policy state): the running replicas'
    reported requests (each averaged over the look-back window by Serve) plus the requests
    queued in the callers' handles for want of a replica, over the target per replica. A replica
    that has not reported yet counts as idle."""
    if ctx.current_num_replicas == 0:
        return ctx.target_num_replicas, {}
    return _requests(ctx) / ctx.config.get_target_ongoing_requests(), {}


def kv_room_policy(ctx: Any) -> tuple[float, dict[str, Any]]:
    """Serve's ``AutoscalingContext`` -> (replicas wanted, policy state): as many as the requests
    call for (``requests_in_engines_policy``) or as keep the running sequences' blocks within
    ``KV_UP_SHARE`` of the fleet's, whichever is more; when that is fewer than run now, only as
    few as keep them within ``KV_DOWN_SHARE``. A replica's blocks are its own report's; one that
    has not reported yet counts as idle, with the blocks of the others."""
    current = ctx.current_num_replicas
    if current == 0:
        return ctx.target_num_replicas, {}
    metrics = ctx.aggregated_metrics or {}
    used = sum(metrics.get(KV_USED_METRIC, {}).get(r, 0.0) for r in ctx.running_replicas)
    totals = [t for r in ctx.running_replicas if (t := metrics.get(KV_TOTAL_METRIC, {}).get(r))]
    by_requests = _requests(ctx) / ctx.config.get_target_ongoing_requests()
    if not totals:  # nothing reported yet
        return by_requests, {}
    per_replica = sum(totals) / len(totals)
    wanted = max(by_requests, used / (KV_UP_SHARE * per_replica))
    if wanted >= current:
        return wanted, {}
    return min(current, max(by_requests, used / (KV_DOWN_SHARE * per_replica))), {}


def _requests(ctx: Any) -> float:
    """The running replicas' reported requests plus those queued in the callers' handles."""
    reported = (ctx.aggregated_metrics or {}).get(LOAD_METRIC, {})
    return sum(reported.get(replica, 0.0) for replica in ctx.running_replicas) + (ctx.total_queued_requests or 0.0)
