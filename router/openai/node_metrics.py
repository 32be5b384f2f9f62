"""``GET /metrics`` on the Serve port: this node's pagefleet series, read from Ray's metrics agent.

pagefleet records its metrics with ``ray.util.metrics``; each node's metrics
agent exports them (``ray_pagefleet_*``) on the node's metrics export port,
which is what Prometheus scrapes on a cluster. For a single node, vLLM users
look at ``/metrics`` on the API port first, so the ingress reads its own
node's agent (a local scrape, the same text Prometheus gets) and passes the
pagefleet families through. On a multi-node cluster this shows only the
ingress's node; scrape every node's agent (deploy/README.md).
"""

from __future__ import annotations

import asyncio
import logging
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from pagefleet.worker.metrics.definitions import EXPORT_PREFIX, PREFIX

logger = logging.getLogger(__name__)

FAMILY_PREFIX = EXPORT_PREFIX + PREFIX  # "ray_pagefleet_"
SCRAPE_TIMEOUT_S = 5.0
# Scrapes within this long of the last one share its page: /metrics is open to anyone who can reach
# the port, and however many ask, the agent is read at most once in this long, on one thread of
# its own (no route's thread pool waits behind it).
CACHE_S = 1.0


def pagefleet_families(exposition: str) -> str:
    """The ``ray_pagefleet_*`` families (samples and their HELP/TYPE lines) of a Prometheus text page."""
    keep = []
    for line in exposition.splitlines():
        if line.startswith("# HELP ") or line.startswith("# TYPE "):
            name = line.split(" ", 3)[2]
        else:
            name = line
        if name.startswith(FAMILY_PREFIX):
            keep.append(line)
    return "\n".join(keep) + ("\n" if keep else "")


class NodeMetricsReader:
    """Finds this node's metrics export port once (from Ray's node table), then scrapes it on demand:
    one scrape at a time, shared by every request that asks while it runs or within ``CACHE_S``."""

    def __init__(self, cache_s: float = CACHE_S) -> None:
        self._port: int | None = None
        self._cache_s = cache_s
        self._page = ""
        self._read_at = -float("inf")
        self._inflight: asyncio.Future | None = None
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="pagefleet-metrics")

    def _find_port(self) -> int | None:
        import ray

        node_id = ray.get_runtime_context().get_node_id()
        for node in ray.nodes():
            if node.get("NodeID") == node_id and node.get("Alive"):
                port = node.get("MetricsExportPort")
                return int(port) if port else None
        return None

    def _scrape(self) -> str:
        if self._port is None:
            self._port = self._find_port()
        if self._port is None:
            return ""
        # The agent listens on all of the node's addresses; this process runs on that node.
        with urllib.request.urlopen(f"http://127.0.0.1:{self._port}/metrics", timeout=SCRAPE_TIMEOUT_S) as resp:
            return pagefleet_families(resp.read().decode("utf-8", "replace"))

    async def read(self) -> str:
        """This node's pagefleet families, or "" (logged) when the agent cannot be read."""
        if time.monotonic() - self._read_at < self._cache_s:
            return self._page
        if self._inflight is None:
            self._inflight = asyncio.ensure_future(self._read_now())
        return await asyncio.shield(self._inflight)  # one caller leaving does not cancel the others' read

    async def _read_now(self) -> str:
        try:
            self._page = await asyncio.get_running_loop().run_in_executor(self._executor, self._scrape)
        except Exception as exc:  # the ingress's own series are still served
            logger.warning("could not read this node's Ray metrics agent: %s", exc)
            self._port = None
            self._page = ""
        finally:
            self._read_at = time.monotonic()
            self._inflight = None
        return self._page
