"""Checks across the deployment files: every setting they set is one the code reads, and the metrics
ports agree between the images, Compose, ECS and the guide.
"""

from __future__ import annotations

import ast
from pathlib import Path

from testing import ROOT
from tests.deploy.deployfiles import (
    API_FILE,
    COMPOSE,
    FARGATE_DOC,
    IMAGES,
    OFFLINE,
    SERVICES,
    WORKER_FILE,
    Dockerfile,
    Stage,
    accepted_env_names,
    api_settings_classes,
    container,
    environment,
    looks_like_setting,
)
from worker.settings import WorkerSettings


def _settings_env(service_names: set[str], images: list[tuple[Dockerfile, list[Stage]]],
                  containers: list[tuple[str, str]]) -> dict[str, str]:
    """TOXFLEET_*/REDIS_URL variables set for some containers, each with where it is set: Compose
    services (with the offline override), Dockerfile stages (ENV with their parents', and their own
    ARGs), ECS containers as (task, container)."""
    found: dict[str, str] = {}
    for compose_file, data in (("docker-compose.yml", COMPOSE), ("+ docker-compose.offline.yml", OFFLINE)):
        for name, service in data["services"].items():
            if name in service_names:
                for var in [*environment(service), *service.get("build", {}).get("args", {})]:
                    found.setdefault(var, f"{compose_file} service {name}")
    for dockerfile, stages in images:
        for stage in stages:
            for var in [*dockerfile.env(stage), *dockerfile.args(stage)]:
                found.setdefault(var, f"{dockerfile.path.name} stage {stage.name}")
    for task, name in containers:
        each = container(task, name)
        for var in [v["name"] for v in each.get("environment", []) + each.get("secrets", [])]:
            found.setdefault(var, f"deploy/ecs/{task}.json container {name}")
    return {k: v for k, v in found.items() if looks_like_setting(k)}


def test_worker_side_variables_are_worker_settings() -> None:
    """Every TOXFLEET_* variable (and REDIS_URL) set for the workers, synth and Flower (which loads
    the worker app), from Compose, both Dockerfiles and the ECS tasks, is read by WorkerSettings."""
    variables = _settings_env({"worker", "synth", "flower"},
                              [(WORKER_FILE, WORKER_FILE.stages), (API_FILE, [API_FILE.stage("flower")])],
                              [("worker", "worker"), ("flower", "flower")])
    assert {"TOXFLEET_MODEL", "TOXFLEET_LOG_FORMAT", "TOXFLEET_METRICS_PORT", "REDIS_URL"} <= set(variables)
    unknown = {var: where for var, where in variables.items() if var not in accepted_env_names(WorkerSettings)}
    assert not unknown, f"not WorkerSettings fields: {unknown}"


def test_api_side_variables_are_api_settings() -> None:
    """Every TOXFLEET_* variable (and REDIS_URL) set for the API is read by the API's settings class."""
    accepted = set().union(*(accepted_env_names(c) for c in api_settings_classes()))
    variables = _settings_env({"api"}, [(API_FILE, API_FILE.stages)], [("api", "api")])
    assert {"TOXFLEET_LOG_FORMAT", "TOXFLEET_API_METRICS_PORT", "REDIS_URL"} <= set(variables)
    unknown = {var: where for var, where in variables.items() if var not in accepted}
    assert not unknown, f"not API settings fields: {unknown}"


def _environ_reads(module_path: Path) -> set[str]:
    """Environment variables a module reads by name (`os.environ.get("X")`, `os.environ["X"]`, `os.getenv("X")`)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(module_path.read_text())):
        target, key = None, None
        if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            target, key = ast.unparse(node.func), node.args[0].value
        elif isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
            target, key = ast.unparse(node.value) + ".__getitem__", node.slice.value
        if target in ("os.environ.get", "os.environ.__getitem__", "os.getenv") and isinstance(key, str):
            names.add(key)
    return names


def test_backlog_variables_are_read_by_the_publisher() -> None:
    """Every TOXFLEET_* variable (and REDIS_URL) the backlog publisher's container gets (Compose, the
    Flower image, ECS) is one tools/backlog.py reads, and means there what the settings field means."""
    variables = _settings_env({"backlog"}, [(API_FILE, [API_FILE.stage("flower")])], [("flower", "backlog")])
    reads = _environ_reads(ROOT / "tools" / "backlog.py")
    assert {"REDIS_URL", "TOXFLEET_LOG_FORMAT"} <= reads  # the parse found them
    assert {"REDIS_URL", "TOXFLEET_LOG_FORMAT"} <= set(variables)
    unknown = {var: where for var, where in variables.items() if var not in reads}
    assert not unknown, f"not read by tools/backlog.py: {unknown}"
    fields = accepted_env_names(WorkerSettings) & set().union(*(accepted_env_names(c) for c in api_settings_classes()))
    assert set(variables) <= fields


def test_worker_metrics_port_is_reachable_on_the_private_network_only() -> None:
    """The worker image's TOXFLEET_METRICS_PORT is the port it EXPOSEs, the one Compose exposes to the
    project network without publishing it, the one the ECS worker task maps, and the one the guide
    opens to the scraper's security group only."""
    stage = IMAGES["worker"][1]
    port = int(WORKER_FILE.env(stage)["TOXFLEET_METRICS_PORT"])
    assert port != 0 and port == WorkerSettings.model_fields["metrics_port"].default
    assert [i.args for i in WORKER_FILE.effective(stage, "EXPOSE")] == [str(port)]
    for services in (SERVICES, OFFLINE["services"]):
        worker = services["worker"]
        assert [str(p) for p in worker["expose"]] == [str(port)] and "ports" not in worker
        assert environment(worker).get("TOXFLEET_METRICS_PORT", str(port)) == str(port)
    assert [p["containerPort"] for p in container("worker").get("portMappings", [])] == [port]
    (row,) = [line for line in FARGATE_DOC.splitlines() if line.startswith("| `sg-worker` |")]
    assert f"{port} (metrics) from `sg-prometheus` only" in row


def test_api_metrics_port_is_reachable_on_the_private_network_only() -> None:
    """The API image serves metrics on a port of its own, on all interfaces (TOXFLEET_API_METRICS_PORT
    and _HOST), EXPOSEd beside 8000; Compose exposes it to the project network without publishing it;
    the ECS task maps it; the guide opens it to the scraper's security group only, and the load
    balancer's target group forwards port 8000 alone. The app has no /metrics route."""
    from api.main import create_app
    from api.settings import ApiSettings

    stage = IMAGES["api"][1]
    env = API_FILE.env(stage)
    port = int(env["TOXFLEET_API_METRICS_PORT"])
    assert port not in (0, 8000) and port == ApiSettings.model_fields["api_metrics_port"].default
    assert port != WorkerSettings.model_fields["metrics_port"].default
    assert env["TOXFLEET_API_METRICS_HOST"] == "0.0.0.0"
    assert ApiSettings.model_fields["api_metrics_host"].default == "127.0.0.1"  # `make run`: loopback
    assert [i.args for i in API_FILE.effective(stage, "EXPOSE")] == [f"8000 {port}"]
    for services in (SERVICES, OFFLINE["services"]):
        api = services["api"]
        assert [str(p) for p in api["expose"]] == [str(port)]
        assert not any(str(port) in str(p) for p in api["ports"])
        assert environment(api).get("TOXFLEET_API_METRICS_PORT", str(port)) == str(port)
    assert [p["containerPort"] for p in container("api")["portMappings"]] == [8000, port]
    (row,) = [line for line in FARGATE_DOC.splitlines() if line.startswith("| `sg-api` |")]
    assert f"{port} (metrics) from `sg-prometheus` only" in row and "8000 from `sg-alb` only" in row
    assert "containerName=api,containerPort=8000" in FARGATE_DOC
    app = create_app(ApiSettings(api_metrics_port=port))
    assert not [r for r in app.routes if "metrics" in getattr(r, "path", "")]
