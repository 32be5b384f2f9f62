"""deploy/: the Serve config against Ray's schema, the Kubernetes and `ray up` manifests,
Prometheus' discovery file name, and the Grafana dashboard's series against the metric table."""

import json
import re
from pathlib import Path

import yaml
from ray._private.ray_constants import PROMETHEUS_SERVICE_DISCOVERY_FILE
from ray.serve.schema import HTTPOptionsSchema, ServeApplicationSchema, ServeDeploySchema

from pagefleet.cluster.config import ServeOptions
from pagefleet.cluster.serve_env import FRONT_PROGRAM, NODE_ENV
from pagefleet.router.metrics import ROUTER_METRICS
from pagefleet.worker.metrics.definitions import ENGINE_METRICS

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
BUILD_APP = "pagefleet.cluster.app:build_app"


def _check_serve_config(config: dict) -> None:
    schema = ServeDeploySchema.model_validate(config)
    # Ray's schema ignores unknown keys; a misspelt one would be silently dropped.
    assert set(config) <= set(ServeDeploySchema.model_fields)
    for app in config["applications"]:
        assert set(app) <= set(ServeApplicationSchema.model_fields)
    assert set(config["http_options"]) <= set(HTTPOptionsSchema.model_fields)
    (app,) = schema.applications
    assert app.import_path == BUILD_APP
    ServeOptions.from_dict(app.args)  # every arg is a pagefleet serve option with a valid value


def test_serve_yaml_validates_against_rays_schema():
    _check_serve_config(yaml.safe_load((DEPLOY / "serve.yaml").read_text()))


def test_serve_yaml_autoscales_the_workers_with_its_commented_keys():
    """The file's autoscaling lines, uncommented, give Serve a worker autoscaling_config it accepts."""
    from ray.serve.config import AutoscalingConfig

    text = (DEPLOY / "serve.yaml").read_text()
    for key in ("target_ongoing_requests", "upscale_delay_s", "downscale_delay_s", "autoscaling_policy",
                "autoscaling_config"):
        text = text.replace(f"# {key}:", f"{key}:")
    config = yaml.safe_load(text.replace("workers: 1 ", 'workers: "1:4" '))
    _check_serve_config(config)
    opts = ServeOptions.from_dict(config["applications"][0]["args"])
    autoscaling = AutoscalingConfig(**opts.worker_autoscaling_config())
    assert (autoscaling.min_replicas, autoscaling.max_replicas, autoscaling.target_ongoing_requests) == (1, 4, 48)
    assert (autoscaling.upscale_delay_s, autoscaling.downscale_delay_s, autoscaling.look_back_period_s) == \
        (30, 600, 30)
    assert autoscaling.policy.policy_function == "pagefleet.worker.replica.autoscaling:requests_in_engines_policy"


def _docs(path: Path) -> dict:
    return {d["kind"]: d for d in yaml.safe_load_all(path.read_text())}


def test_rayservice_serves_build_app_on_gpu_workers_and_is_scraped():
    docs = _docs(DEPLOY / "kuberay" / "rayservice.yaml")
    service, monitor = docs["RayService"], docs["PodMonitor"]
    assert service["apiVersion"] == "ray.io/v1"
    serve_config = yaml.safe_load(service["spec"]["serveConfigV2"])
    _check_serve_config(serve_config)
    args = serve_config["applications"][0]["args"]
    cluster = service["spec"]["rayClusterConfig"]
    (gpu_group,) = cluster["workerGroupSpecs"]
    gpus_per_pod = int(gpu_group["rayStartParams"]["num-gpus"])
    assert gpus_per_pod == args["tensor_parallel_size"]  # a replica's STRICT_PACK group fits one pod
    assert gpu_group["replicas"] * gpus_per_pod == args["workers"] * args["tensor_parallel_size"]
    (worker,) = gpu_group["template"]["spec"]["containers"]
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == gpus_per_pod
    # Serve's high-throughput mode, Ray's workers at niceness 0 and no OpenMP spin on every pod
    # (each node's raylet and Serve processes read them at start)
    for group in (cluster["headGroupSpec"], gpu_group):
        (container,) = group["template"]["spec"]["containers"]
        env = {e["name"]: e["value"] for e in container["env"]}
        front = env.pop("RAY_SERVE_HAPROXY_BINARY_PATH")  # HAProxy with pagefleet's bounds
        assert env == NODE_ENV and front == f"/home/ray/anaconda3/bin/{FRONT_PROGRAM}"
    # The PodMonitor's port is a named container port on every Ray pod, the agent's export port.
    port_name = monitor["spec"]["podMetricsEndpoints"][0]["port"]
    selector = monitor["spec"]["selector"]["matchLabels"]
    for group in (cluster["headGroupSpec"], gpu_group):
        (container,) = group["template"]["spec"]["containers"]
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert ports[port_name] == int(group["rayStartParams"]["metrics-export-port"])
        assert selector.items() <= group["template"]["metadata"]["labels"].items()


def test_ray_up_cluster_exports_metrics_with_token_auth():
    config = yaml.safe_load((DEPLOY / "ray-cluster.yaml").read_text())
    head = " ".join(config["head_start_ray_commands"])
    workers = " ".join(config["worker_start_ray_commands"])
    for command in (head, workers):
        assert "RAY_AUTH_MODE=token" in command and "--metrics-export-port=8080" in command
        assert all(f"{name}={value} " in command for name, value in NODE_ENV.items())
        assert f"RAY_SERVE_HAPROXY_BINARY_PATH=$HOME/pagefleet/.venv/bin/{FRONT_PROGRAM} " in command
    assert "~/.ray/auth_token" in config["file_mounts"]


def test_prometheus_reads_rays_discovery_file():
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    (job,) = config["scrape_configs"]
    (sd,) = job["file_sd_configs"]
    assert [Path(f).name for f in sd["files"]] == [PROMETHEUS_SERVICE_DISCOVERY_FILE]


def dashboard_exprs() -> list[str]:
    dash = json.loads((DEPLOY / "grafana" / "pagefleet.json").read_text())
    return [t["expr"] for p in dash["panels"] for t in p["targets"]]


def exported_series() -> set[str]:
    names = set()
    for spec in list(ENGINE_METRICS.values()) + list(ROUTER_METRICS.values()):
        names.add(spec.exported)
        if spec.kind == "histogram":
            names |= {spec.exported + suffix for suffix in ("_bucket", "_sum", "_count")}
    return names


def test_dashboard_names_only_series_pagefleet_exports():
    dash = json.loads((DEPLOY / "grafana" / "pagefleet.json").read_text())
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert {"model_name", "replica"} <= set(variables)
    titles = {p["title"] for p in dash["panels"]}
    assert titles == {"Time to first token", "Inter-token latency", "End-to-end request latency",
                      "Tokens per second", "Requests per second by status", "Running and waiting per replica",
                      "KV cache usage per replica", "Prefix cache hit rate", "Routing decisions and fallbacks",
                      "Admission queue and 429s", "Preemptions per second"}
    used = {name for expr in dashboard_exprs() + [v.get("definition", "") for v in variables.values()]
            for name in re.findall(r"\bray_pagefleet_\w+", expr)}
    assert used and used <= exported_series(), used - exported_series()


# Who may reach which port: docs/security.md's threat model, as each deploy file applies it.
LOOPBACK = ("127.0.0.1", "localhost", "::1")


def _serve_app_args(config: dict) -> dict:
    (app,) = config["applications"]
    return app["args"]


def test_serve_yaml_binds_loopback_and_needs_a_key_to_bind_anything_else():
    config = yaml.safe_load((DEPLOY / "serve.yaml").read_text())
    assert config["http_options"]["host"] in LOOPBACK
    assert "api_key" not in _serve_app_args(config)  # no key in a file that is committed


def test_ray_up_cluster_keeps_the_dashboard_on_the_head_and_ray_behind_its_token():
    config = yaml.safe_load((DEPLOY / "ray-cluster.yaml").read_text())
    head = " ".join(config["head_start_ray_commands"])
    assert "--dashboard-host=127.0.0.1" in head and "0.0.0.0" not in head
    assert all("RAY_AUTH_MODE=token" in c for c in config["head_start_ray_commands"] + config["worker_start_ray_commands"]
               if "ray start" in c)


def test_rayservice_has_ray_token_auth_an_api_key_and_a_network_policy():
    docs = list(yaml.safe_load_all((DEPLOY / "kuberay" / "rayservice.yaml").read_text()))
    service = next(d for d in docs if d["kind"] == "RayService")
    cluster = service["spec"]["rayClusterConfig"]
    assert cluster["authOptions"] == {"mode": "token"}
    serve_config = yaml.safe_load(service["spec"]["serveConfigV2"])
    args = _serve_app_args(serve_config)
    assert serve_config["http_options"]["host"] == "0.0.0.0"  # a Kubernetes Service fronts it...
    key_file = args["api_key_file"]  # ...so the API wants a key, from a Secret mounted on the head
    assert "api_key" not in args
    (head,) = cluster["headGroupSpec"]["template"]["spec"]["containers"]
    mount = next(m for m in head["volumeMounts"] if key_file.startswith(m["mountPath"] + "/"))
    volume = next(v for v in cluster["headGroupSpec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"])
    assert "secretName" in volume["secret"]
    policy = next(d for d in docs if d["kind"] == "NetworkPolicy")
    labels = cluster["headGroupSpec"]["template"]["metadata"]["labels"]
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= labels.items()
    open_ports = {p["port"] for rule in policy["spec"]["ingress"] if "from" not in rule for p in rule["ports"]}
    assert open_ports == {8000, 8080}  # the API and the metrics agents; Ray's own ports only from its pods
