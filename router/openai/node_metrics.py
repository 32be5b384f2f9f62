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
import urllib.request

from pagefleet.worker.metrics.definitions import EXPORT_PREFIX, PREFIX

logger = logging.getLogger(__name__)

FAMILY_PREFIX = EXPORT_PREFIX + PREFIX  # "ray_pagefleet_"
SCRAPE_TIMEOUT_S = 5.0


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
    """Finds this node's metrics export port once (from Ray's node table), then scrapes it on demand."""

    def __init__(self) -> None:
        self._port: int | None = None

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
        try:
            return await asyncio.to_thread(self._scrape)
        except Exception as exc:  # the ingress's own series are still served
            logger.warning("could not read this node's Ray metrics agent: %s", exc)
            self._port = None
            return ""
