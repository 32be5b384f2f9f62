"""A Ray cluster of `ray start` nodes on this machine, for tests that need real nodes.

Every port is chosen free and every node has this cluster's own temp dir, so
nothing is shared with another Ray on the machine; ``stop()`` ends exactly the
processes this cluster started (found by its temp dir and GCS address), never
with a machine-wide ``ray stop``.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from conftest import free_port

BIN = Path(sys.executable).parent


def _processes() -> dict[int, tuple[int, str]]:
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            args = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        out[int(entry)] = (ppid, args)
    return out


class RayNodes:
    def __init__(self) -> None:
        self.temp_dir = tempfile.mkdtemp(prefix="/tmp/pf-2n-")  # short: unix socket paths
        self.token = secrets.token_hex(32)
        # Token auth as Ray's docs give it: the mode, and the cluster's token on every node.
        # Metrics reported each second (Ray's default is 10 s) so a test reads them sooner.
        self.env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": self.token,
                    "OMP_WAIT_POLICY": "PASSIVE", "RAY_metrics_report_interval_ms": "1000"}
        self.gcs_port = free_port()
        self.dashboard_port = free_port()
        self.metrics_ports: list[int] = []
        self.node_manager_ports: list[int] = []
        self.address: str | None = None

    def _ports(self) -> list[str]:
        metrics, node_manager = free_port(), free_port()
        self.metrics_ports.append(metrics)
        self.node_manager_ports.append(node_manager)
        return [f"--metrics-export-port={metrics}", f"--node-manager-port={node_manager}",
                f"--object-manager-port={free_port()}", f"--dashboard-agent-listen-port={free_port()}",
                f"--dashboard-agent-grpc-port={free_port()}", f"--runtime-env-agent-port={free_port()}",
                "--disable-usage-stats"]

    def _ray_start(self, args: list[str]) -> str:
        done = subprocess.run([str(BIN / "ray"), "start", *args], env=self.env, capture_output=True, text=True,
                              timeout=180)
        if done.returncode != 0:
            raise RuntimeError(f"ray start failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
        return done.stdout + done.stderr

    def start_head(self, num_cpus: int) -> None:
        self._ray_start(["--head", f"--port={self.gcs_port}", f"--temp-dir={self.temp_dir}",
                         f"--num-cpus={num_cpus}", "--num-gpus=0", "--include-dashboard=true",
                         "--dashboard-host=127.0.0.1", f"--dashboard-port={self.dashboard_port}",
                         f"--ray-client-server-port={free_port()}", *self._ports()])
        ip = subprocess.run([sys.executable, "-c", "import ray; print(ray.util.get_node_ip_address())"],
                            capture_output=True, text=True, env=self.env, timeout=60).stdout.strip()
        self.address = f"{ip}:{self.gcs_port}"

    def add_node(self, num_cpus: int) -> None:
        self._ray_start([f"--address={self.address}", f"--num-cpus={num_cpus}", "--num-gpus=0", *self._ports()])

    @property
    def dashboard(self) -> str:
        return f"http://127.0.0.1:{self.dashboard_port}"

    def raylet_pid(self, node_index: int) -> int:
        flag = f"--node_manager_port={self.node_manager_ports[node_index]}"
        pids = [pid for pid, (_, args) in _processes().items() if "/raylet " in args and flag in args]
        if len(pids) != 1:
            raise RuntimeError(f"expected one raylet with {flag}, found {pids}")
        return pids[0]

    def own_pids(self) -> set[int]:
        """Every process of this cluster: those naming its temp dir or GCS address, and their children."""
        procs = _processes()
        markers = [self.temp_dir] + ([self.address] if self.address else [])
        roots = {pid for pid, (_, args) in procs.items()
                 if pid != os.getpid() and any(m in args for m in markers)}
        children: dict[int, list[int]] = {}
        for pid, (ppid, _) in procs.items():
            children.setdefault(ppid, []).append(pid)
        found, stack = set(), list(roots)
        while stack:
            pid = stack.pop()
            if pid not in found:
                found.add(pid)
                stack.extend(children.get(pid, []))
        return found

    def stop(self) -> set[int]:
        """End this cluster's processes (TERM, then KILL after 10 s); returns those still alive (none)."""
        pids = self.own_pids()
        for sig, wait_s in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
            for pid in pids:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + wait_s
            while time.monotonic() < deadline and (pids := {p for p in pids if _alive(p)}):
                time.sleep(0.2)
            if not pids:
                break
        left = {p for p in self.own_pids() if _alive(p)}
        if not left:
            shutil.rmtree(self.temp_dir, ignore_errors=True)
        return left


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"
