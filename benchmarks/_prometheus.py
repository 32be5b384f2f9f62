"""A real Prometheus over a local Ray cluster, configured by deploy/prometheus/prometheus.yml,
and the Grafana dashboard's queries evaluated against it. The metrics tests
(tests/serving/test_prometheus.py) and `routing.py --simulate GPU --prometheus` share it."""

from __future__ import annotations

import json
import re
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import httpx
import yaml

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "deploy" / "grafana" / "pagefleet.json"
RATE_WINDOW = "1m"  # what Grafana's $__rate_interval stands for at a 1 s scrape interval


@contextmanager
def running_prometheus(binary: str, work: Path, port: int, *, ray_temp_dir: str | None = None,
                       targets: list[str] | None = None) -> Iterator[str]:
    """Prometheus with deploy/prometheus/prometheus.yml, scraping each second, the Ray metrics
    agents that the service-discovery file in ``ray_temp_dir`` lists (Ray's dashboard writes it),
    or else ``targets`` (HOST:PORT, as ``pagefleet serve``'s banner names them: it runs Ray
    without the dashboard); yields its base URL once it is ready, and stops it after."""
    config = yaml.safe_load((ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text())
    config["global"].update(scrape_interval="1s", evaluation_interval="1s")
    job = config["scrape_configs"][0]
    if ray_temp_dir is not None:
        sd = job["file_sd_configs"][0]
        sd["files"] = [str(Path(ray_temp_dir) / Path(f).name) for f in sd["files"]]
        sd["refresh_interval"] = "1s"
    else:
        del job["file_sd_configs"]
        job["static_configs"] = [{"targets": list(targets or ())}]
    # Every target of a local cluster runs on this machine and its agents listen on all
    # addresses: scrape them over loopback (the discovery file names the node's own address).
    job["relabel_configs"] = [
        {"source_labels": ["__address__"], "regex": r"[^:]+:(\d+)", "target_label": "__address__",
         "replacement": "127.0.0.1:$1"}]
    work.mkdir(parents=True, exist_ok=True)
    (work / "prometheus.yml").write_text(yaml.safe_dump(config))
    log = work / "prometheus.log"
    with open(log, "w") as err:
        proc = subprocess.Popen([binary, f"--config.file={work / 'prometheus.yml'}",
                                 f"--storage.tsdb.path={work / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
                                stdout=subprocess.DEVNULL, stderr=err)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"Prometheus exited: {log.read_text()[-2000:]}")
            try:
                if httpx.get(f"{base}/-/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("Prometheus did not become ready in 60 s")
            time.sleep(0.5)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def query(prom: str, expr: str) -> list[dict]:
    """An instant query's result rows; a refused query raises RuntimeError."""
    r = httpx.get(f"{prom}/api/v1/query", params={"query": expr}, timeout=30)
    body = r.json() if r.headers.get("content-type", "").startswith("application/json") else {}
    if r.status_code != 200 or body.get("status") != "success":
        raise RuntimeError(f"{expr}: {r.status_code} {r.text[:500]}")
    return body["data"]["result"]


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title or variable, expression) for every query of the Grafana dashboard."""
    dash = json.loads(DASHBOARD.read_text())
    out = [(p["title"], t["expr"]) for p in dash["panels"] for t in p["targets"]]
    out += [(f"variable {v['name']}", v["definition"]) for v in dash["templating"]["list"] if v["type"] == "query"]
    return out


def as_promql(expr: str) -> str:
    """Grafana's variables as Grafana sends them with "All" selected."""
    return expr.replace("$__rate_interval", RATE_WINDOW).replace("$model_name", ".*").replace("$replica", ".*")


def returns_data(prom: str, expr: str) -> bool:
    match = re.fullmatch(r"label_values\((.*), (\w+)\)", expr)
    if match:  # a variable: the label must have values on the series
        return bool(query(prom, f"count by ({match.group(2)}) ({as_promql(match.group(1))})"))
    return bool(query(prom, as_promql(expr)))


def queries_without_data(prom: str, within_s: float = 30.0) -> list[tuple[str, str]]:
    """The dashboard's queries that return no data. One that is momentarily empty (a gauge
    between two exports of a busy agent) gets more scrapes, for up to ``within_s``."""
    missing = dashboard_queries()
    deadline = time.monotonic() + within_s
    while True:
        missing = [(title, expr) for title, expr in missing if not returns_data(prom, expr)]
        if not missing or time.monotonic() > deadline:
            return missing
        time.sleep(2)
