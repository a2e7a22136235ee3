"""Static checks of the CloudFormation template (deploy/cloudformation/toxfleet.yaml).

No AWS account needed. What can run here does: cfn-lint (AWS's own linter, with the resource schemas),
the generator that writes the template's task definitions from deploy/ecs, and the template's own
parameter constraints and Rules, evaluated here the way CloudFormation evaluates them before it
creates anything (AllowedValues, AllowedPattern, MinValue/MaxValue, then each Rule's assertions).
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import redis
import yaml

from api.settings import ApiSettings
from fleet import logs
from fleet import redis_url as urls
from testing import ROOT
from tests.deploy.deployfiles import (
    FARGATE_DOC,
    FARGATE_SIZES,
    TASK_DEFINITIONS,
    TEMPLATE_PATH,
    container,
    load_ecs,
    load_template,
)
from tools import backlog, cfn_template
from worker.settings import WorkerSettings

TEMPLATE = load_template()
PARAMETERS: dict[str, dict[str, Any]] = TEMPLATE["Parameters"]
RESOURCES: dict[str, dict[str, Any]] = TEMPLATE["Resources"]
RULES: dict[str, dict[str, Any]] = TEMPLATE["Rules"]
SIZED_TASKS = {"Worker": "worker", "Api": "api"}
"""Tasks whose CPU and memory are parameters: template prefix -> deploy/ecs task."""


def props(name: str) -> dict[str, Any]:
    properties: dict[str, Any] = RESOURCES[name]["Properties"]
    return properties


def of_type(kind: str) -> dict[str, dict[str, Any]]:
    return {name: r for name, r in RESOURCES.items() if r["Type"] == kind}


# ---- what CloudFormation checks before it creates anything ---------------------------------------

def _resolve(expr: Any, values: dict[str, Any]) -> Any:
    """A Rules expression: the condition functions Rules allow, over the given parameter values."""
    if isinstance(expr, dict):
        ((fn, arg),) = expr.items()
        if fn == "Ref":
            return values[arg]
        args = [_resolve(a, values) for a in arg]
        if fn == "Fn::Equals":
            return args[0] == args[1]
        if fn == "Fn::Not":
            return not args[0]
        if fn == "Fn::And":
            return all(args)
        if fn == "Fn::Or":
            return any(args)
        if fn == "Fn::Contains":
            return args[1] in args[0]
        raise AssertionError(f"a function Rules do not allow: {fn}")
    if isinstance(expr, list):
        return [_resolve(e, values) for e in expr]
    return expr


def refusals(overrides: dict[str, str]) -> list[str]:
    """The messages CloudFormation would refuse these parameter values with (none: accepted). Values
    are given as the CLI gives them (strings); the others take their defaults."""
    raw = {name: str(p.get("Default", "")) for name, p in PARAMETERS.items()} | overrides
    missing = [name for name, p in PARAMETERS.items() if "Default" not in p and name not in overrides]
    assert not missing, f"give a value for {missing}"
    messages: list[str] = []
    values: dict[str, Any] = {}
    for name, p in PARAMETERS.items():
        value = raw[name]
        why = p.get("ConstraintDescription", "")
        if p["Type"] == "CommaDelimitedList":
            values[name] = value.split(",")
            continue
        values[name] = value
        if "AllowedValues" in p and value not in [str(v) for v in p["AllowedValues"]]:
            messages.append(f"{name}: {why}")
        if "AllowedPattern" in p and not re.fullmatch(p["AllowedPattern"], value):
            messages.append(f"{name}: {why}")
        if "MaxLength" in p and len(value) > p["MaxLength"]:
            messages.append(f"{name}: {why}")
        if p["Type"] == "Number":
            number = float(value)
            if number < p.get("MinValue", float("-inf")) or number > p.get("MaxValue", float("inf")):
                messages.append(f"{name}: out of range")
    if messages:
        return messages  # CloudFormation stops at parameter validation
    for rule in RULES.values():
        if "RuleCondition" in rule and not _resolve(rule["RuleCondition"], values):
            continue
        messages += [a["AssertDescription"] for a in rule["Assertions"] if not _resolve(a["Assert"], values)]
    return messages


IMAGES = {"ApiImage": "123456789012.dkr.ecr.eu-west-1.amazonaws.com/toxfleet-api:abc1234",
          "WorkerImage": "123456789012.dkr.ecr.eu-west-1.amazonaws.com/toxfleet-worker:abc1234",
          "FlowerImage": "123456789012.dkr.ecr.eu-west-1.amazonaws.com/toxfleet-flower:abc1234"}


def test_defaults_are_accepted() -> None:
    """The template deploys with nothing but the three image URIs (a new VPC, the JSON's sizes)."""
    assert refusals(IMAGES) == []


@pytest.mark.parametrize("prefix", SIZED_TASKS)
def test_every_fargate_size_and_only_those_is_accepted(prefix: str) -> None:
    """For each task CPU, exactly Fargate's memory sizes pass the parameter constraints and the Rules,
    every other memory (512 MiB steps up to 120 GiB) and every other CPU is refused, and the message
    names the parameter and the sizes that would work."""
    cpu, memory = f"{prefix}Cpu", f"{prefix}Memory"
    assert {int(v) for v in PARAMETERS[cpu]["AllowedValues"]} == set(FARGATE_SIZES)
    for units, sizes in FARGATE_SIZES.items():
        for mib in range(512, 122881, 512):
            refused = refusals(IMAGES | {cpu: str(units), memory: str(mib)})
            if mib in sizes:
                assert refused == [], (units, mib)
            else:
                (message,) = refused
                assert message.startswith(f"{memory}: with {cpu} {units} ")
                assert str(min(sizes)) in message and str(max(sizes)) in message
    for bad in ("300", "4 vCPU", "32768", ""):
        assert refusals(IMAGES | {cpu: bad}) == [f"{cpu}: {PARAMETERS[cpu]['ConstraintDescription']}"]


def test_worker_architecture_is_one_of_the_two() -> None:
    """X86_64 and ARM64 deploy; anything else (arm64, AMD64, an empty value) is refused by name."""
    for good in ("X86_64", "ARM64"):
        assert refusals(IMAGES | {"WorkerCpuArchitecture": good}) == []
    for bad in ("arm64", "AMD64", "x86_64", "", "ARM"):
        (message,) = refusals(IMAGES | {"WorkerCpuArchitecture": bad})
        assert message == "WorkerCpuArchitecture: X86_64 or ARM64, the two CPU architectures Fargate runs"
    worker = props("WorkerTaskDefinition")
    assert worker["RuntimePlatform"]["CpuArchitecture"] == {"Ref": "WorkerCpuArchitecture"}


@pytest.mark.parametrize(("overrides", "expected"), [
    ({"ApiImage": "toxfleet-api"}, "ApiImage: an image URI with a tag"),
    ({"WorkerImage": "repo:tag with space"}, "WorkerImage: an image URI with a tag"),
    ({"VpcId": "vpc-0123456789abcdef0"}, "PrivateSubnetIds: with VpcId"),
    ({"VpcId": "my-vpc"}, "VpcId: empty, or a VPC id"),
    ({"PrivateSubnetIds": "subnet-0123456789abcdef0,subnet-0fedcba9876543210"},
     "PublicSubnetIds/PrivateSubnetIds: leave"),
    ({"VpcCidr": "10.0.0.0/8"}, "VpcCidr: an IPv4 CIDR from /16 to /20"),
    ({"RedisReplicationGroupId": "Toxfleet"}, "RedisReplicationGroupId: lower-case letters"),
    ({"LogRetentionDays": "10"}, "LogRetentionDays: one of CloudWatch Logs' retention periods"),
    ({"CertificateArn": "my-cert"}, "CertificateArn: empty, or an ACM certificate ARN"),
])
def test_bad_values_are_refused_with_a_message(overrides: dict[str, str], expected: str) -> None:
    messages = refusals(IMAGES | overrides)
    assert any(m.startswith(expected) for m in messages), messages


def test_an_existing_vpc_with_its_subnets_is_accepted() -> None:
    subnets = "subnet-0123456789abcdef0,subnet-0fedcba9876543210"
    assert refusals(IMAGES | {"VpcId": "vpc-0123456789abcdef0", "PrivateSubnetIds": subnets,
                              "PublicSubnetIds": subnets, "CertificateArn":
                              "arn:aws:acm:eu-west-1:123456789012:certificate/0a1b2c3d-1111-2222-3333-444455556666",
                              "AlarmEmail": "oncall@example.com"}) == []


# ---- one source of truth: the task definitions come from deploy/ecs ------------------------------

def test_template_is_current_with_the_ecs_json() -> None:
    """The committed template's generated block is what the generator writes from deploy/ecs now."""
    text = TEMPLATE_PATH.read_text()
    assert cfn_template.render(text) == text, "stale: run `python -m tools.cfn_template`"
    assert cfn_template.main(["--check"]) == 0


def test_a_changed_task_definition_makes_the_template_stale(monkeypatch: pytest.MonkeyPatch) -> None:
    """The staleness check can fail: a worker command changed in the JSON changes the template."""
    real = cfn_template.load

    def changed(name: str) -> dict[str, Any]:
        data = real(name)
        if name == "worker":
            data["containerDefinitions"][0]["command"].append("--concurrency=1")
        return data

    monkeypatch.setattr(cfn_template, "load", changed)
    assert cfn_template.main(["--check"]) == 1


@pytest.mark.parametrize(("value", "complaint"), [
    ("${AWS_ACCOUNT_ID}.dkr.ecr.${AWS_REGION}.amazonaws.com/toxfleet-other:${IMAGE_TAG}", "no image parameter"),
    ("arn:aws:ssm:${AWS_REGION}:${AWS_ACCOUNT_ID}:parameter/toxfleet/new-secret", "no secret in the stack"),
    ("http://${SOME_HOST}:8000", "no stack value for placeholder"),
])
def test_generator_refuses_what_it_cannot_translate(value: str, complaint: str) -> None:
    """A placeholder, repository or SSM parameter the template has no counterpart for is an error,
    never copied through as a literal `${...}` that CloudFormation would then reject or misread."""
    with pytest.raises(cfn_template.TemplateError, match=complaint):
        cfn_template.convert({"value": value}, "test")


@pytest.mark.parametrize("task", TASK_DEFINITIONS)
def test_task_definitions_carry_the_json_containers(task: str) -> None:
    """Each template task definition holds the JSON's containers (names, commands, ports, health
    checks, stop timeouts), and its CPU, memory and architecture parameters default to the JSON's."""
    data = load_ecs(task)
    prefix = cfn_template.TASKS[task][0]
    template = props(f"{prefix}TaskDefinition")
    assert template["Family"] == data["family"]
    pairs = zip(template["ContainerDefinitions"], data["containerDefinitions"], strict=True)
    for ours, theirs in pairs:
        assert ours["Name"] == theirs["name"] and ours["Command"] == theirs["command"]
        assert ours.get("HealthCheck", {}).get("Command") == theirs.get("healthCheck", {}).get("command")
        assert ours["StopTimeout"] == theirs["stopTimeout"]
        assert [p["ContainerPort"] for p in ours.get("PortMappings", [])] == \
            [p["containerPort"] for p in theirs.get("portMappings", [])]
        assert ours["LogConfiguration"]["Options"]["awslogs-group"] == {"Ref": "LogGroup"}
    for field, key in (("Cpu", "cpu"), ("Memory", "memory")):
        value = template[field]
        assert (PARAMETERS[value["Ref"]]["Default"] if isinstance(value, dict) else value) == data[key]
    arch = template["RuntimePlatform"]["CpuArchitecture"]
    assert (PARAMETERS[arch["Ref"]]["Default"] if isinstance(arch, dict) else arch) == \
        data["runtimePlatform"]["cpuArchitecture"]


# ---- cfn-lint ------------------------------------------------------------------------------------

def _cfn_lint(path: Path) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("cfn-lint", path=str(Path(sys.executable).parent)) or shutil.which("cfn-lint")
    if exe is None:
        pytest.skip("cfn-lint is not installed (pip install -e '.[dev]' installs it)")
    return subprocess.run([exe, "--format", "parseable", str(path)], capture_output=True, text=True, timeout=300)


def test_cfn_lint_finds_nothing(tmp_path: Path) -> None:
    """cfn-lint reports no error and no warning on the template; the same run on a copy with one
    wrong value (Redis's TLS mode misspelt) does report it, so the check is live."""
    result = _cfn_lint(TEMPLATE_PATH)
    assert result.returncode == 0, result.stdout + result.stderr
    broken = tmp_path / "broken.yaml"
    text = TEMPLATE_PATH.read_text()
    broken.write_text(text.replace("TransitEncryptionMode: required", "TransitEncryptionMode: requird", 1))
    result = _cfn_lint(broken)
    assert result.returncode & 2, result.stdout  # bit 2: errors
    assert "E3030:'requird' is not one of" in result.stdout


# ---- what the stack holds ------------------------------------------------------------------------

def test_alb_idle_timeout_is_below_the_api_keep_alive() -> None:
    """The ALB closes idle connections before the API does (else the ALB may reuse a connection the
    API has just closed: an intermittent 502); it is internet-facing and forwards port 8000 only."""
    command = container("api")["command"]
    keep_alive = int(command[command.index("--timeout-keep-alive") + 1])
    alb = props("LoadBalancer")
    attributes = {a["Key"]: a["Value"] for a in alb["LoadBalancerAttributes"]}
    assert int(attributes["idle_timeout.timeout_seconds"]) < keep_alive
    assert alb["Scheme"] == "internet-facing" and len(of_type("AWS::ElasticLoadBalancingV2::LoadBalancer")) == 1
    group = props("ApiTargetGroup")
    assert group["Port"] == 8000 and group["HealthCheckPath"] == "/healthz" and group["TargetType"] == "ip"
    delay = {a["Key"]: a["Value"] for a in group["TargetGroupAttributes"]}["deregistration_delay.timeout_seconds"]
    assert int(delay) > ApiSettings.model_fields["max_wait"].default  # a long poll finishes on scale-in
    (balanced,) = [s for s in of_type("AWS::ECS::Service").values() if "LoadBalancers" in s["Properties"]]
    assert balanced["Properties"]["LoadBalancers"][0]["ContainerName"] == "api"
    # ECS refuses a target group no listener forwards to: the service waits for both listeners, the
    # HTTPS one (conditional) through a handle, since a DependsOn cannot name a conditional resource.
    assert balanced["DependsOn"] == "ListenersReady"
    assert RESOURCES["ListenersReady"]["Metadata"] == {
        "HttpsListener": {"Fn::If": ["Https", {"Ref": "HttpsListener"}, ""]}, "HttpListener": {"Ref": "HttpListener"}}
    assert RESOURCES["HttpsListener"]["Condition"] == "Https"
    forward = [{"Type": "forward", "TargetGroupArn": {"Ref": "ApiTargetGroup"}}]
    assert props("HttpsListener")["DefaultActions"] == forward


def test_no_resource_depends_on_one_that_may_not_exist() -> None:
    """A DependsOn naming a resource whose condition may be false fails the whole stack: every
    dependency is unconditional, or under the same condition as its dependent."""
    for name, resource in RESOURCES.items():
        needs = resource.get("DependsOn", [])
        for other in [needs] if isinstance(needs, str) else needs:
            assert RESOURCES[other].get("Condition") in (None, resource.get("Condition")), (name, other)


def test_redis_is_multi_az_with_tls_and_a_generated_auth_token() -> None:
    """ElastiCache: two nodes in two AZs with automatic failover, TLS required in transit, encrypted at
    rest, AUTH from a generated Secrets Manager secret, noeviction; the tasks' REDIS_URL is built
    from the same secret and the primary endpoint, as rediss:// with certificate checks, a form
    toxfleet's URL owner accepts."""
    group = props("RedisReplicationGroup")
    assert group["NumCacheClusters"] >= 2 and group["MultiAZEnabled"] and group["AutomaticFailoverEnabled"]
    assert group["TransitEncryptionEnabled"] and group["TransitEncryptionMode"] == "required"
    assert group["AtRestEncryptionEnabled"]
    token = "{{resolve:secretsmanager:${RedisAuthSecret}:SecretString:token}}"
    assert group["AuthToken"] == {"Fn::Sub": token}
    generated = props("RedisAuthSecret")["GenerateSecretString"]
    assert generated["GenerateStringKey"] == "token" and generated["ExcludePunctuation"] is True
    assert 16 <= generated["PasswordLength"] <= 128  # ElastiCache's AUTH token length
    assert props(group["CacheParameterGroupName"]["Ref"])["Properties"] == {"maxmemory-policy": "noeviction"}
    url = props("RedisUrlSecret")["SecretString"]["Fn::Sub"]
    assert url.startswith(f"rediss://:{token}@${{RedisReplicationGroup.PrimaryEndPoint.Address}}:")
    sample = (url.replace(token, "a1B2" * 16)
              .replace("${RedisReplicationGroup.PrimaryEndPoint.Address}", "primary.example")
              .replace("${RedisReplicationGroup.PrimaryEndPoint.Port}", "6379"))
    assert WorkerSettings(REDIS_URL=sample).redis_url == sample  # type: ignore[call-arg]
    pool = urls.sync_client(sample).connection_pool  # no connection is made
    assert pool.connection_class is redis.SSLConnection
    assert pool.connection_kwargs["ssl_cert_reqs"] == "required" and pool.connection_kwargs["password"] == "a1B2" * 16
    assert pool.connection_kwargs["host"] == "primary.example"


def test_secrets_are_generated_and_each_role_reads_only_its_own() -> None:
    """No secret is a parameter or typed into the template: each is generated, or assembled from a
    generated one. Each task's execution role may read exactly the secrets its containers name."""
    assert not [p for p in PARAMETERS if re.search(r"password|token|secret|key", p, re.I)]
    for name, secret in of_type("AWS::SecretsManager::Secret").items():
        spec = secret["Properties"]
        assert "GenerateSecretString" in spec or "{{resolve:secretsmanager:" in json.dumps(spec["SecretString"]), name
    for task in TASK_DEFINITIONS:
        prefix = cfn_template.TASKS[task][0]
        definition = props(f"{prefix}TaskDefinition")
        named = {s["ValueFrom"]["Ref"] for c in definition["ContainerDefinitions"] for s in c.get("Secrets", [])}
        role = props(definition["ExecutionRoleArn"]["Fn::GetAtt"][0])
        (policy,) = role["Policies"]
        (statement,) = policy["PolicyDocument"]["Statement"]
        assert statement["Action"] == "secretsmanager:GetSecretValue"
        assert {r["Ref"] for r in statement["Resource"]} == named


def test_task_roles_hold_least_privilege_and_flower_allows_ecs_exec() -> None:
    """The API's and the workers' task roles hold no permission (they call no AWS API); Flower's holds
    exactly the four ssmmessages actions ECS Exec needs, and its service enables ECS Exec. No policy
    anywhere allows every action."""
    for prefix in ("Api", "Worker"):
        assert "Policies" not in props(f"{prefix}TaskRole") and "ManagedPolicyArns" not in props(f"{prefix}TaskRole")
    (policy,) = props("FlowerTaskRole")["Policies"]
    (statement,) = policy["PolicyDocument"]["Statement"]
    assert sorted(statement["Action"]) == ["ssmmessages:CreateControlChannel", "ssmmessages:CreateDataChannel",
                                           "ssmmessages:OpenControlChannel", "ssmmessages:OpenDataChannel"]
    assert props("FlowerTaskDefinition")["TaskRoleArn"] == {"Fn::GetAtt": ["FlowerTaskRole", "Arn"]}
    assert props("FlowerService")["EnableExecuteCommand"] is True
    text = json.dumps(RESOURCES)
    assert '"Action": "*"' not in text and '"*:*"' not in text


def test_only_the_load_balancer_is_open_and_metrics_ports_are_the_scrapers() -> None:
    """Only the ALB's security group admits an address range; Redis admits the three task groups on
    6379; every metrics port admits the scraper's group alone; tasks get no public address."""
    groups = of_type("AWS::EC2::SecurityGroup")
    for name, group in groups.items():
        for rule in group["Properties"].get("SecurityGroupIngress", []):
            if name == "AlbSecurityGroup":
                assert rule["CidrIp"] == {"Ref": "AlbIngressCidr"}
                continue
            assert "CidrIp" not in rule, name
            if rule["FromPort"] in (9808, 9809, 5555):
                assert rule["SourceSecurityGroupId"] == {"Ref": "PrometheusSecurityGroup"}, name
    redis_sources = {r["SourceSecurityGroupId"]["Ref"] for r in props("RedisSecurityGroup")["SecurityGroupIngress"]}
    assert redis_sources == {"ApiSecurityGroup", "WorkerSecurityGroup", "FlowerSecurityGroup"}
    for service in of_type("AWS::ECS::Service").values():
        network = service["Properties"]["NetworkConfiguration"]["AwsvpcConfiguration"]
        assert network["AssignPublicIp"] == "DISABLED"


def test_logs_have_retention() -> None:
    (group,) = of_type("AWS::Logs::LogGroup").values()
    assert group["Properties"]["RetentionInDays"] == {"Ref": "LogRetentionDays"}
    assert PARAMETERS["LogRetentionDays"]["Default"] in PARAMETERS["LogRetentionDays"]["AllowedValues"]


def test_workers_scale_on_the_backlog_the_publisher_emits() -> None:
    """Target tracking on toxfleet/BacklogPerTask for Service=toxfleet-worker, the name of the worker
    service the scalable target points at; the publisher runs once, in a Flower service that never
    runs two tasks, even during a deployment."""
    doc = backlog.emf(backlog.Backlog(queued=3, unacked=1, workers=2), backlog.DEFAULT_SERVICE, 0.0)
    metric = props("WorkerScalingPolicy")["TargetTrackingScalingPolicyConfiguration"]["CustomizedMetricSpecification"]
    assert (metric["Namespace"], metric["MetricName"]) == (backlog.NAMESPACE, "BacklogPerTask")
    assert metric["Dimensions"] == [{"Name": "Service", "Value": doc["Service"]}]
    assert props("WorkerService")["ServiceName"] == backlog.DEFAULT_SERVICE
    assert props("WorkerScalableTarget")["ResourceId"] == {"Fn::Sub": "service/${Cluster}/${WorkerService.Name}"}
    assert props("WorkerScalingPolicy")["ScalingTargetId"] == {"Ref": "WorkerScalableTarget"}
    flower = props("FlowerService")
    assert flower["DesiredCount"] == 1 and flower["DeploymentConfiguration"]["MaximumPercent"] == 100
    targets = of_type("AWS::ApplicationAutoScaling::ScalableTarget").values()
    assert not any("FlowerService" in json.dumps(t) for t in targets)


ALARMED = {
    "NoLiveWorkersAlarm": ("toxfleet", "Workers"),
    "FastPathLostAlarm": ("toxfleet", "FallbackWorkers"),
    "BacklogPerWorkerHighAlarm": ("toxfleet", "BacklogPerTask"),
    "RedisUnreachableAlarm": ("toxfleet", "BacklogPerTask"),
    "Api5xxRatioAlarm": ("AWS/ApplicationELB", "HTTPCode_Target_5XX_Count"),
    "ApiErrorBudgetBurnAlarm": ("AWS/ApplicationELB", "HTTPCode_Target_5XX_Count"),
    **{f"ApiErrorBudgetSlowBurn{w}Alarm": ("AWS/ApplicationELB", "HTTPCode_Target_5XX_Count")
       for w in ("1d", "2h", "3d", "6h")},
    "JobLatencyP99Alarm": ("toxfleet", "JobLatency"),
    "ApiP99LatencyAlarm": ("AWS/ApplicationELB", "TargetResponseTime"),
    "ApiNoHealthyTargetAlarm": ("AWS/ApplicationELB", "HealthyHostCount"),
    "ScoringFailuresAlarm": ("toxfleet", "WorkerErrorLines"),
    "RedisMemoryHighAlarm": ("AWS/ElastiCache", "DatabaseMemoryUsagePercentage"),
    "RedisEngineCpuHighAlarm": ("AWS/ElastiCache", "EngineCPUUtilization"),
}
"""Each alarm and a metric it reads."""

SLOW_BURN_WINDOWS = {"1d": (86400, 1, 3), "2h": (7200, 1, 3), "3d": (86400, 3, 1), "6h": (21600, 1, 1)}
"""The slow burn's windows: period, periods that must all breach, and the burn rate (x the 0.1 % budget)."""


def _metrics(alarm: dict[str, Any]) -> list[tuple[str, str]]:
    if "MetricName" in alarm:
        return [(alarm["Namespace"], alarm["MetricName"])]
    return [(m["MetricStat"]["Metric"]["Namespace"], m["MetricStat"]["Metric"]["MetricName"])
            for m in alarm["Metrics"] if "MetricStat" in m]


def test_alarms_cover_the_conditions_and_notify() -> None:
    """One alarm per condition, each reading the metric named here, notifying the topic on alarm and
    on recovery, with a description that says what to check first."""
    alarms = of_type("AWS::CloudWatch::Alarm")
    assert set(alarms) == set(ALARMED)
    windows = {f"ApiErrorBudgetSlowBurn{w}Alarm" for w in SLOW_BURN_WINDOWS}
    for name, alarm in alarms.items():
        spec = alarm["Properties"]
        assert ALARMED[name] in _metrics(spec), name
        if name in windows:  # parts of the composite alarm, which notifies for them
            assert "AlarmActions" not in spec and "OKActions" not in spec, name
            assert "ApiErrorBudgetSlowBurnAlarm" in spec["AlarmDescription"], name
            continue
        assert spec["AlarmActions"] == spec["OKActions"] == [{"Ref": "AlarmTopic"}]
        assert "First checks" in spec["AlarmDescription"], name
    (composite,) = of_type("AWS::CloudWatch::CompositeAlarm").values()
    spec = composite["Properties"]
    assert spec["AlarmActions"] == spec["OKActions"] == [{"Ref": "AlarmTopic"}]
    assert "First checks" in spec["AlarmDescription"]


def test_publisher_metrics_the_alarms_read_are_the_ones_it_emits() -> None:
    """The toxfleet-namespace alarms read metrics the publisher's EMF line defines, with its dimension."""
    doc = backlog.emf(backlog.Backlog(queued=0, unacked=0, workers=1), backlog.DEFAULT_SERVICE, 0.0,
                      latencies=[1.5])
    (directive,) = doc["_aws"]["CloudWatchMetrics"]
    emitted = {m["Name"] for m in directive["Metrics"]}
    for alarm in of_type("AWS::CloudWatch::Alarm").values():
        spec = alarm["Properties"]
        if spec.get("Namespace") == backlog.NAMESPACE and spec["MetricName"] != "WorkerErrorLines":
            assert spec["MetricName"] in emitted
            assert spec["Dimensions"] == [{"Name": "Service", "Value": backlog.DEFAULT_SERVICE}]


def test_idle_fleet_raises_no_alarm() -> None:
    """No traffic is not an error: alarms on request-driven metrics treat missing data as fine, and the
    5xx ratio counts as 0 below 20 requests a minute. Missing data means trouble only where a point is
    always due: the publisher's reading each minute, the ALB's healthy-host count."""
    alarms = {n: a["Properties"] for n, a in of_type("AWS::CloudWatch::Alarm").items()}
    breaching = {n for n, a in alarms.items() if a["TreatMissingData"] == "breaching"}
    assert breaching == {"RedisUnreachableAlarm", "ApiNoHealthyTargetAlarm"}
    (ratio,) = [m for m in alarms["Api5xxRatioAlarm"]["Metrics"] if m.get("ReturnData")]
    assert ratio["Expression"].startswith("IF(requests >= 20, ") and ratio["Expression"].endswith(", 0)")
    (burn,) = [m for m in alarms["ApiErrorBudgetBurnAlarm"]["Metrics"] if m.get("ReturnData")]
    assert burn["Expression"].startswith("IF(requests >= 100, ") and burn["Expression"].endswith(", 0)")
    assert PARAMETERS["WorkerMinCount"]["MinValue"] >= 1  # so "no live worker" is never the idle state
    assert refusals(IMAGES | {"WorkerMinCount": "0"}) == ["WorkerMinCount: out of range"]


def test_error_budget_alarm_is_the_fast_burn_of_the_prometheus_rules() -> None:
    """The burn alarm's threshold is the fast-burn rule's rate (14.4x a 0.1 % budget, in percent), held
    over an hour of 5-minute periods, as ToxfleetErrorBudgetBurnFast's long window."""
    rules = yaml.safe_load((ROOT / "deploy" / "prometheus" / "toxfleet-rules.yml").read_text())
    (fast,) = [r for g in rules["groups"] for r in g["rules"] if r.get("alert") == "ToxfleetErrorBudgetBurnFast"]
    assert "rate1h > 14.4 * 0.001" in fast["expr"]
    burn = props("ApiErrorBudgetBurnAlarm")
    assert burn["Threshold"] == pytest.approx(14.4 * 0.001 * 100)
    assert burn["EvaluationPeriods"] == burn["DatapointsToAlarm"] == 12
    periods = {m["MetricStat"]["Period"] for m in burn["Metrics"] if "MetricStat" in m}
    assert periods == {300} and 12 * 300 == 3600


def _prometheus_rule(alert: str) -> dict[str, Any]:
    rules = yaml.safe_load((ROOT / "deploy" / "prometheus" / "toxfleet-rules.yml").read_text())
    (rule,) = [r for g in rules["groups"] for r in g["rules"] if r.get("alert") == alert]
    found: dict[str, Any] = rule
    return found


def test_slow_burn_alarm_is_the_slow_burn_of_the_prometheus_rules() -> None:
    """Each window alarm holds the slow-burn rule's rate (in percent of requests) over its window, and the
    composite alarm joins them as the rule does: (1 day and 2 hours at 3x) or (3 days and 6 hours at 1x)."""
    expr = " ".join(_prometheus_rule("ToxfleetErrorBudgetBurnSlow")["expr"].split())
    r = "toxfleet:http_error_ratio:rate"
    assert expr == f"({r}1d > 3 * 0.001 and {r}2h > 3 * 0.001) or ({r}3d > 1 * 0.001 and {r}6h > 1 * 0.001)"
    for window, (period, evaluations, rate) in SLOW_BURN_WINDOWS.items():
        alarm = props(f"ApiErrorBudgetSlowBurn{window}Alarm")
        assert alarm["Threshold"] == pytest.approx(rate * 0.001 * 100), window
        assert alarm["EvaluationPeriods"] == alarm["DatapointsToAlarm"] == evaluations, window
        assert {m["MetricStat"]["Period"] for m in alarm["Metrics"] if "MetricStat" in m} == {period}, window
        assert period * evaluations <= 7 * 86400 and period <= 86400  # CloudWatch's limits
        (ratio,) = [m for m in alarm["Metrics"] if m.get("ReturnData")]
        assert re.match(r"IF\(requests >= (100|1000), ", ratio["Expression"]), window  # a quiet API never fires
    rule = " ".join(props("ApiErrorBudgetSlowBurnAlarm")["AlarmRule"]["Fn::Sub"].split())
    assert rule == ('(ALARM("${ApiErrorBudgetSlowBurn1dAlarm}") AND ALARM("${ApiErrorBudgetSlowBurn2hAlarm}"))'
                    ' OR (ALARM("${ApiErrorBudgetSlowBurn3dAlarm}") AND ALARM("${ApiErrorBudgetSlowBurn6hAlarm}"))')


def test_job_latency_alarm_is_the_prometheus_job_latency_rule() -> None:
    """p99 of the publisher's JobLatency over 5 minutes, above ToxfleetJobLatencyHigh's 30 s for its 10 minutes."""
    rule = _prometheus_rule("ToxfleetJobLatencyHigh")
    assert rule["expr"] == "toxfleet:job_latency_seconds:p99_5m > 30" and rule["for"] == "10m"
    alarm = props("JobLatencyP99Alarm")
    assert alarm["ExtendedStatistic"] == "p99" and alarm["Period"] == 300
    assert alarm["Period"] * alarm["EvaluationPeriods"] == 600
    assert alarm["Threshold"] == {"Ref": "JobLatencyP99AlarmSeconds"}
    assert PARAMETERS["JobLatencyP99AlarmSeconds"]["Default"] == 30
    assert alarm["TreatMissingData"] == "notBreaching"


def test_backlog_alarm_threshold_is_five_minutes_of_work() -> None:
    """The backlog alarm's default is what a task clears in 5 minutes: 10 x the scaling target (30 s)."""
    target = load_ecs("worker-scaling")["TargetTrackingScalingPolicyConfiguration"]["TargetValue"]
    assert PARAMETERS["BacklogPerTaskAlarmThreshold"]["Default"] == pytest.approx(10 * target)
    assert props("BacklogPerWorkerHighAlarm")["EvaluationPeriods"] * props("BacklogPerWorkerHighAlarm")["Period"] == 300


def _filter_matches(pattern: str, line: dict[str, Any]) -> bool:
    """The metric filter's pattern for the shape used: `{ ($.level = "A" || $.level = "B") && $.logger = "p*" }`."""
    levels = re.findall(r'\$\.level = "(\w+)"', pattern)
    (prefix,) = re.findall(r'\$\.logger = "([\w.]+)\*"', pattern)
    return line["level"] in levels and line["logger"].startswith(prefix)


def test_scoring_failure_lines_feed_the_metric_filter(caplog: pytest.LogCaptureFixture) -> None:
    """The filter matches the JSON line the worker writes when a batch fails to score (logger
    worker.tasks, level ERROR) and not its INFO lines nor the API's errors."""
    (metric_filter,) = of_type("AWS::Logs::MetricFilter").values()
    pattern = metric_filter["Properties"]["FilterPattern"]
    formatter = logs.JsonFormatter()

    def line(name: str, level: int) -> dict[str, Any]:
        record = logging.LogRecord(name, level, __file__, 1, "batch x: scoring failed", None, None)
        parsed: dict[str, Any] = json.loads(formatter.format(record))
        return parsed

    assert _filter_matches(pattern, line("worker.tasks", logging.ERROR))
    assert _filter_matches(pattern, line("worker.batching", logging.ERROR))
    assert not _filter_matches(pattern, line("worker.tasks", logging.INFO))
    assert not _filter_matches(pattern, line("api.main", logging.ERROR))
    assert 'logger.exception("batch %s: scoring failed"' in (ROOT / "worker" / "tasks.py").read_text()


def test_guide_deploys_the_stack() -> None:
    """The guide's main path is `aws cloudformation deploy` of this template, with CAPABILITY_IAM."""
    (command,) = re.findall(r"aws cloudformation deploy (?:[^\n]*\\\n)*[^\n]*", FARGATE_DOC)
    assert "--template-file deploy/cloudformation/toxfleet.yaml" in command
    assert "CAPABILITY_IAM" in command
    for name in IMAGES:
        assert f"{name}=" in command
