"""Static checks of the ECS task definitions and scaling policies in deploy/ecs: the ECS and Application
Auto Scaling APIs' own request models (botocore), Fargate sizes, secrets, the guide's placeholders.
"""

from __future__ import annotations

import re
from typing import Any

import pytest

from tests.deploy.deployfiles import (
    BACKLOG_COMMAND,
    ECS_DIR,
    EXPECTED_PORTS,
    FARGATE_DOC,
    FARGATE_SIZES,
    SCALING_POLICIES,
    SECRET_WORDS,
    SERVICES,
    STOP_TIMEOUT_MAX,
    TASK_DEFINITIONS,
    check_policy_tracks,
    cmd,
    container,
    load_ecs,
    placeholders,
)
from tools import backlog
from toxfleet import contract


def _botocore_shape(service: str, operation: str) -> Any:
    botocore_session = pytest.importorskip("botocore.session", reason="botocore not installed (dev extra)")
    model = botocore_session.get_session().get_service_model(service)
    return model.operation_model(operation).input_shape


@pytest.mark.parametrize("name", TASK_DEFINITIONS)
def test_task_definitions_fit_the_ecs_api(name: str) -> None:
    """Each task definition is a valid RegisterTaskDefinition request (botocore's ECS model)."""
    from botocore.validate import ParamValidator

    report = ParamValidator().validate(load_ecs(name), _botocore_shape("ecs", "RegisterTaskDefinition"))
    assert not report.has_errors(), report.generate_report()


@pytest.mark.parametrize("name", SCALING_POLICIES)
def test_scaling_policies_fit_the_autoscaling_api(name: str) -> None:
    """Each scaling policy is a valid PutScalingPolicy request (botocore's Application Auto Scaling model)."""
    from botocore.validate import ParamValidator

    shape = _botocore_shape("application-autoscaling", "PutScalingPolicy")
    report = ParamValidator().validate(load_ecs(name), shape)
    assert not report.has_errors(), report.generate_report()


@pytest.mark.parametrize("name", TASK_DEFINITIONS)
def test_task_definitions_are_fargate_tasks_with_logs_and_health(name: str) -> None:
    """Fargate, awsvpc, a valid CPU/memory pair; every container essential, from ECR, with awslogs
    under its own stream prefix; the task's own container with a health check in range and its port."""
    task = load_ecs(name)
    assert task["requiresCompatibilities"] == ["FARGATE"] and task["networkMode"] == "awsvpc"
    assert int(task["memory"]) in FARGATE_SIZES[int(task["cpu"])]
    registry = "${AWS_ACCOUNT_ID}.dkr.ecr.${AWS_REGION}.amazonaws.com"
    prefixes = []
    for each in task["containerDefinitions"]:
        assert each["essential"] is True
        assert re.fullmatch(re.escape(registry) + r"/toxfleet-(api|worker|flower):\$\{IMAGE_TAG\}", each["image"])
        logs = each["logConfiguration"]
        assert logs["logDriver"] == "awslogs"
        assert {"awslogs-group", "awslogs-region", "awslogs-stream-prefix"} <= set(logs["options"])
        prefixes.append(logs["options"]["awslogs-stream-prefix"])
        assert each["stopTimeout"] <= STOP_TIMEOUT_MAX
        assert each["linuxParameters"]["initProcessEnabled"] is True  # SIGTERM reaches the process
    assert len(set(prefixes)) == len(prefixes)
    own = container(name)
    assert own["image"] == f"{registry}/toxfleet-{name}:${{IMAGE_TAG}}"
    check = own["healthCheck"]
    assert 5 <= check["interval"] <= 300 and 2 <= check["timeout"] <= 60 and check["timeout"] < check["interval"]
    assert 1 <= check["retries"] <= 10 and 0 <= check["startPeriod"] <= 300
    ports = [p["containerPort"] for c in task["containerDefinitions"] for p in c.get("portMappings", [])]
    assert ports == EXPECTED_PORTS[name]


@pytest.mark.parametrize("name", TASK_DEFINITIONS)
def test_task_commands_match_the_images(name: str) -> None:
    """The command each task definition's own container runs is its image's CMD."""
    assert container(name)["command"] == cmd(name)


def test_worker_task_is_sized_like_the_users_and_drains_on_stop() -> None:
    """The worker task is 4 vCPU / 8 GB and gets Fargate's full 120 s to finish batches after SIGTERM."""
    task = load_ecs("worker")
    assert (task["cpu"], task["memory"]) == ("4096", "8192")
    assert container("worker")["stopTimeout"] == STOP_TIMEOUT_MAX


@pytest.mark.parametrize("name", TASK_DEFINITIONS)
def test_task_definitions_hold_no_secrets(name: str) -> None:
    """Secret-looking variables and the Redis URL (it carries the password) come only from SSM or
    Secrets Manager references, in every container; no plain environment value carries credentials."""
    for each in load_ecs(name)["containerDefinitions"]:
        for var in each.get("environment", []):
            assert not any(word in var["name"].upper() for word in SECRET_WORDS), var
            assert not re.search(r"://[^/\s]*:[^/\s]*@", var["value"]), var
            assert var["name"] != "REDIS_URL"
        secrets = {s["name"]: s["valueFrom"] for s in each["secrets"]}
        assert "REDIS_URL" in secrets
        for value in secrets.values():
            assert value.startswith(("arn:aws:ssm:", "arn:aws:secretsmanager:")), value
    own = {s["name"] for s in container(name)["secrets"]}
    if name == "flower":
        assert "FLOWER_BASIC_AUTH" in own
    if name == "api":  # public behind the load balancer: bearer keys on
        assert "TOXFLEET_API_KEYS" in own


def test_placeholders_are_the_documented_ones() -> None:
    """The ${...} placeholders in deploy/ecs are exactly those the guide's envsubst call fills (an
    unlisted one would stay literal; listing them keeps envsubst off the health check's $(...))."""
    used = set().union(*(placeholders((ECS_DIR / f"{n}.json").read_text())
                         for n in TASK_DEFINITIONS + SCALING_POLICIES))
    calls = re.findall(r"envsubst '([^']+)'", FARGATE_DOC)
    assert calls, "the guide shows no envsubst call"
    for call in calls:
        assert set(re.findall(r"\$\{?(\w+)\}?", call)) <= used
    assert set().union(*(set(re.findall(r"\$\{?(\w+)\}?", c)) for c in calls)) == used


def test_worker_scaling_tracks_what_the_publisher_emits() -> None:
    """Workers scale on the metric tools/backlog.py emits (namespace, name, Service dimension, taken
    from its own EMF output), the Service value is the scaled ECS service, the deployment does not
    override it, and the guide names the metric; the API scales on ALB requests."""
    doc = backlog.emf(backlog.Backlog(queued=3, unacked=1, workers=2), backlog.DEFAULT_SERVICE, 0.0)
    check_policy_tracks(doc)
    policy = load_ecs("worker-scaling")
    metric = policy["TargetTrackingScalingPolicyConfiguration"]["CustomizedMetricSpecification"]
    assert (metric["Namespace"], metric["MetricName"]) == (backlog.NAMESPACE, "BacklogPerTask")
    assert doc["BacklogPerTask"] == 2.0  # (3 waiting + 1 unacked) / 2 workers: per task, in messages
    assert metric["Statistic"] == "Average"
    assert policy["ResourceId"] == f"service/toxfleet/{backlog.DEFAULT_SERVICE}"
    assert "--service" not in SERVICES["backlog"]["command"] + container("flower", "backlog")["command"]
    assert f"{backlog.NAMESPACE}/BacklogPerTask" in FARGATE_DOC and f"Service={backlog.DEFAULT_SERVICE}" in FARGATE_DOC
    api = load_ecs("api-scaling")["TargetTrackingScalingPolicyConfiguration"]
    assert api["PredefinedMetricSpecification"]["PredefinedMetricType"] == "ALBRequestCountPerTarget"


TARGET_LINE = re.compile(r"`TargetValue` = \*\*([\d.]+)\*\* s × \*\*([\d.]+)\*\* texts/s ÷ \*\*([\d.]+)\*\* texts per "
                         r"message = \*\*([\d.]+)\*\* messages per task")


def test_worker_scaling_target_is_the_documented_derivation() -> None:
    """worker-scaling.json's TargetValue is, in messages, the guide's worked formula (acceptable wait ×
    texts/s per task ÷ texts per message, at most CHUNK_TEXTS per message), and the measured
    throughput stays an explicit placeholder in the prose."""
    (found,) = TARGET_LINE.findall(FARGATE_DOC)
    wait, rate, per_message, target = map(float, found)
    assert wait * rate / per_message == pytest.approx(target)
    assert 1 <= per_message <= contract.CHUNK_TEXTS
    value = load_ecs("worker-scaling")["TargetTrackingScalingPolicyConfiguration"]["TargetValue"]
    assert value == pytest.approx(target)
    assert "<MEASURED: texts/s per task" in FARGATE_DOC
    assert "not built yet" not in FARGATE_DOC and "PutMetricData permission" not in FARGATE_DOC.replace("**", "")


def test_flower_task_runs_the_publisher_once() -> None:
    """In ECS the publisher is an essential, restartable second container of the Flower task (the
    Flower image, the same REDIS_URL secret), the only one anywhere, in a service kept at one task."""
    publisher, flower = container("flower", "backlog"), container("flower")
    assert publisher["command"] == BACKLOG_COMMAND and publisher["image"] == flower["image"]
    assert publisher["essential"] is True and publisher["restartPolicy"]["enabled"] is True
    assert publisher["secrets"] == [s for s in flower["secrets"] if s["name"] == "REDIS_URL"]
    assert "portMappings" not in publisher
    running = [(task, c["name"]) for task in TASK_DEFINITIONS for c in load_ecs(task)["containerDefinitions"]
               if "tools.backlog" in " ".join(c.get("command", []))]
    assert running == [("flower", "backlog")]
    (create,) = [c for c in re.findall(r"aws ecs create-service (?:[^\n]*\\\n)*[^\n]*", FARGATE_DOC)
                 if "--service-name toxfleet-flower" in c]
    assert "--desired-count 1" in create
    assert not any("toxfleet-flower" in load_ecs(p)["ResourceId"] for p in SCALING_POLICIES)


def test_flower_task_has_a_role_for_ecs_exec() -> None:
    """The guide reaches Flower through ECS Exec, which runs under the task role: flower.json names one,
    and the guide gives that role exactly ECS Exec's ssmmessages channel actions."""
    task = load_ecs("flower")
    assert task["taskRoleArn"] == "arn:aws:iam::${AWS_ACCOUNT_ID}:role/toxfleet-flower"
    (line,) = [line for line in FARGATE_DOC.splitlines() if line.startswith("- `toxfleet-flower` (task role")]
    assert "ECS Exec" in line
    for action in ("CreateControlChannel", "CreateDataChannel", "OpenControlChannel", "OpenDataChannel"):
        assert f"`ssmmessages:{action}`" in FARGATE_DOC
    assert "--enable-execute-command" in FARGATE_DOC
