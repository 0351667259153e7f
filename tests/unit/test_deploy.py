"""Everything under deploy/ parses, has the fields its consumer (KubeRay, Kubernetes, Ray's
cluster launcher, Grafana, Docker) requires, and runs `kvmesh` commands our parser accepts."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvmesh.client.environment import read_environment
from kvmesh.client.parser import build_parser

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
KUBERAY = DEPLOY / "kuberay"
LOOPBACK = re.compile(r"redis[s]?://[^\s\"']*(127\.0\.0\.1|localhost)")


def documents(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def kuberay_docs() -> list[dict[str, Any]]:
    return [d for p in sorted(KUBERAY.glob("*.yaml")) for d in documents(p)]


def one(kind: str) -> dict[str, Any]:
    found = [d for d in kuberay_docs() if d["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


def kvmesh_commands(script: str, env: dict[str, str]) -> list[list[str]]:
    """Each `kvmesh ...` invocation in a shell script, its $VARIABLES replaced from `env`."""
    commands = []
    for match in re.finditer(r"(?<![\w/-])kvmesh\s+[^;&|>]+", script):
        text = match.group(0)
        for name in re.findall(r"\$\{?(\w+)\}?", text):
            assert name in env, f"{name} is not defined for: {text}"
        text = re.sub(r"\$\{?(\w+)\}?", lambda m: env[m.group(1)], text)
        commands.append(shlex.split(text)[1:])
    return commands


def assert_parses(argv: list[str], env: dict[str, str]) -> None:
    parser = build_parser(read_environment(env))
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # argparse names the bad flag on stderr
        raise AssertionError(f"`kvmesh {' '.join(argv)}` does not parse") from exit_
    assert args.command in ("up", "serve")


# ---- KubeRay ---------------------------------------------------------------------------------


def test_every_manifest_parses_and_names_an_api_version_and_kind() -> None:
    paths = sorted(KUBERAY.glob("*.yaml"))
    assert {p.name for p in paths} >= {"raycluster.yaml", "redis.yaml", "kustomization.yaml"}
    for doc in kuberay_docs():
        assert doc.get("apiVersion") and doc.get("kind"), doc


def test_kustomization_lists_every_manifest_and_only_existing_ones() -> None:
    kustomization = documents(KUBERAY / "kustomization.yaml")[0]
    listed = set(kustomization["resources"])
    assert all((KUBERAY / name).is_file() for name in listed)
    assert listed == {p.name for p in KUBERAY.glob("*.yaml")} - {"kustomization.yaml"}


def test_raycluster_has_the_fields_kuberay_requires() -> None:
    cluster = one("RayCluster")
    assert cluster["apiVersion"] == "ray.io/v1"
    spec = cluster["spec"]
    head = spec["headGroupSpec"]
    assert isinstance(head["rayStartParams"], dict)
    head_containers = head["template"]["spec"]["containers"]
    assert head_containers and all(c["image"] and c["name"] for c in head_containers)
    groups = spec["workerGroupSpecs"]
    assert groups
    for group in groups:
        assert group["groupName"] and isinstance(group["rayStartParams"], dict)
        assert 0 <= group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
        containers = group["template"]["spec"]["containers"]
        assert containers and all(c["image"] for c in containers)
        for c in containers:
            limits, requests = c["resources"]["limits"], c["resources"]["requests"]
            assert {"cpu", "memory"} <= set(limits)
            if "nvidia.com/gpu" in requests or group["groupName"].startswith("gpu"):
                # Kubernetes: an extended resource's request must equal its limit.
                assert int(limits["nvidia.com/gpu"]) >= 1
                assert (
                    requests.get("nvidia.com/gpu", limits["nvidia.com/gpu"])
                    == limits["nvidia.com/gpu"]
                )


def test_with_overwritten_commands_every_container_still_runs_rays_start() -> None:
    cluster = one("RayCluster")
    assert cluster["metadata"]["annotations"]["ray.io/overwrite-container-cmd"] == "true"
    spec = cluster["spec"]
    groups = [spec["headGroupSpec"], *spec["workerGroupSpecs"]]
    for group in groups:
        for c in group["template"]["spec"]["containers"]:
            assert "$KUBERAY_GEN_RAY_START_CMD" in " ".join(c["args"]), c["name"]


def test_the_head_runs_kvmesh_serve_with_real_flags_and_is_ready_by_grpc_health() -> None:
    head = one("RayCluster")["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e.get("value", "placeholder") for e in head["env"]}
    env["REDIS_PASSWORD"] = "pw"
    env["KVMESH_REDIS_URL"] = "redis://:pw@kvmesh-redis:6379/0"
    commands = kvmesh_commands(" ".join(head["args"]), env)
    assert [c[0] for c in commands] == ["serve"]
    serve = commands[0]
    assert_parses(serve, {})
    args = build_parser(read_environment({})).parse_args(serve)
    assert args.host == "0.0.0.0" and args.metrics_port > 0 and args.workers >= 1
    assert head["readinessProbe"]["grpc"]["port"] == args.port
    # NOT_SERVING (no worker to route to yet) must make the head unready, never restart it.
    assert "grpc" not in head["livenessProbe"]
    ports = {p["containerPort"] for p in head["ports"]}
    assert {args.port, args.metrics_port} <= ports
    assert not LOOPBACK.search(json.dumps(head))


def test_redis_statefulset_and_services_select_the_pods_they_serve() -> None:
    statefulset = one("StatefulSet")
    pod_labels = statefulset["spec"]["template"]["metadata"]["labels"]
    assert statefulset["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    services = {d["metadata"]["name"]: d for d in kuberay_docs() if d["kind"] == "Service"}
    redis_service = services[statefulset["spec"]["serviceName"]]
    assert redis_service["spec"]["selector"].items() <= pod_labels.items()
    head_url = next(
        e["value"]
        for e in one("RayCluster")["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0][
            "env"
        ]
        if e["name"] == "KVMESH_REDIS_URL"
    )
    assert f"@{redis_service['metadata']['name']}:6379/" in head_url
    coordinator = services["kvmesh"]["spec"]["selector"]
    assert coordinator == {"ray.io/cluster": "kvmesh", "ray.io/node-type": "head"}


# ---- Ray cluster launcher ----------------------------------------------------------------------


def test_ray_cluster_yaml_installs_this_checkout_and_gives_no_loopback_redis() -> None:
    text = (DEPLOY / "ray" / "cluster.yaml").read_text()
    config = yaml.safe_load(text)
    assert "example.invalid" not in text and not LOOPBACK.search(text)
    assert config["file_mounts"]["~/kvmesh"] == "."
    assert any("pip install ~/kvmesh" in c for c in config["setup_commands"])
    for key in ("cluster_name", "provider", "available_node_types", "head_node_type"):
        assert key in config
    assert config["head_node_type"] in config["available_node_types"]
    head_start = " ".join(config["head_start_ray_commands"])
    # Ray's GCS must not take the port the index's Redis listens on.
    assert "--port=6380" in head_start and "6380" in " ".join(config["worker_start_ray_commands"])
    env = {"HEAD_IP": "10.0.0.1", "REDIS_PW": "pw", "USER": "u", "HOME": "/h"}
    commands = kvmesh_commands(head_start, env)
    assert [c[0] for c in commands] == ["serve"]
    assert_parses(commands[0], {"KVMESH_REDIS_URL": "redis://:pw@10.0.0.1:6379/0"})


# ---- container image -----------------------------------------------------------------------------


def test_the_dockerfile_has_both_variants_and_copies_every_package_root() -> None:
    text = (DEPLOY / "docker" / "Dockerfile").read_text()
    assert re.search(r"^ARG VARIANT=cpu$", text, re.M)
    stages = set(re.findall(r"^FROM \S+ AS (\S+)$", text, re.M))
    assert stages == {"base-cpu", "base-cuda"}
    assert re.search(r"^FROM base-\$\{VARIANT\}$", text, re.M)
    # [tool.setuptools.package-dir]: "kvmesh.x" = "folder/..." (no TOML parser on Python 3.10)
    pyproject = (ROOT / "pyproject.toml").read_text()
    roots = set(re.findall(r'^"kvmesh\.[\w.]+" = "(\w+)', pyproject, re.M))
    assert roots
    copied = set(re.findall(r"^COPY (\w+) \./\1$", text, re.M))
    assert roots <= copied, f"not copied into the image: {roots - copied}"
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert not roots & set(ignored)


def test_pyproject_lists_every_package_folder() -> None:
    """A folder with an `__init__.py` that pyproject.toml does not list is left out of every
    wheel and image (an editable install still imports it, so no other test notices)."""
    pyproject = (ROOT / "pyproject.toml").read_text()
    mapped = set(re.findall(r'^"(kvmesh\.[\w.]+)" = "([\w/]+)"', pyproject, re.M))
    listed = set(re.findall(r'^    "(kvmesh\.[\w.]+)",$', pyproject, re.M))
    roots = {folder.split("/")[0] for _, folder in mapped}
    folders = {
        str(init.parent.relative_to(ROOT))
        for root in roots
        for init in (ROOT / root).rglob("__init__.py")
    }
    packages = {("kvmesh." + folder.replace("/", "."), folder) for folder in folders}
    assert packages <= mapped, f"not in package-dir: {packages - mapped}"
    assert {name for name, _ in packages} == listed


@pytest.mark.slow
def test_what_the_image_copies_builds_a_wheel_with_every_package(tmp_path: Path) -> None:
    """The image's `pip install .` without a container tool: the files its COPY lines name, and
    only those, must build a wheel holding every package pyproject.toml lists."""
    text = (DEPLOY / "docker" / "Dockerfile").read_text()
    context = tmp_path / "context"
    context.mkdir()
    for line in re.findall(r"^COPY (.+) \S+$", text, re.M):
        for name in line.split():
            source = ROOT / name
            if source.is_dir():
                shutil.copytree(
                    source, context / name, ignore=shutil.ignore_patterns("__pycache__")
                )
            else:
                shutil.copy(source, context / name)
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q"]
        + ["-w", str(tmp_path / "dist"), str(context)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert built.returncode == 0, built.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("kvmesh-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        folders = {str(Path(n).parent) for n in archive.namelist() if n.endswith(".py")}
    pyproject = (ROOT / "pyproject.toml").read_text()
    packages = set(re.findall(r'^\s+"(kvmesh\.[\w.]+)",$', pyproject, re.M))
    assert packages and {p.replace(".", "/") for p in packages} <= folders


def docker_daemon_answers() -> bool:
    if shutil.which("docker") is None:
        return False
    try:
        return subprocess.run(["docker", "info"], capture_output=True, timeout=20).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.mark.slow
@pytest.mark.skipif(not docker_daemon_answers(), reason="no docker, or its daemon is unreachable")
def test_the_cpu_image_builds_and_runs_the_cli() -> None:
    tag = "kvmesh-test:cpu"
    build = subprocess.run(
        ["docker", "build", "-f", "deploy/docker/Dockerfile", "-t", tag, "."],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=3600,
    )
    assert build.returncode == 0, build.stderr[-3000:]
    run = subprocess.run(
        ["docker", "run", "--rm", tag, "kvmesh", "serve", "--help"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0 and "--metrics-port" in run.stdout


# ---- Grafana -----------------------------------------------------------------------------------


def exported_metric_names(*, with_histogram_families: bool = False) -> set[str]:
    """Series names a scrape returns (a histogram's `_bucket`, `_count`, `_sum`), and with
    `with_histogram_families` the histograms' own names, which prose may name."""
    from tests.unit.test_telemetry import families, make

    *_, collector, _ = make(engine_streams=lambda: {"e0": {"batches": 1}})  # with an engine
    exported: set[str] = set()
    for name, family in families(collector).items():
        suffixes = ("_bucket", "_count", "_sum") if family.histogram is not None else ("",)
        exported |= {name + s for s in suffixes}
        if with_histogram_families:
            exported.add(name)
    return exported


def test_the_dashboard_queries_only_metrics_the_collector_exports() -> None:
    dashboard = json.loads((DEPLOY / "grafana" / "kvmesh.json").read_text())
    assert dashboard["uid"] and dashboard["panels"]
    queried = set()
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            queried |= set(re.findall(r"kvmesh_[a-z0-9_]+", target["expr"]))
    exported = exported_metric_names()
    assert queried and queried <= exported, f"not exported: {queried - exported}"


def test_the_dashboard_is_a_well_formed_grafana_dashboard() -> None:
    dashboard = json.loads((DEPLOY / "grafana" / "kvmesh.json").read_text())
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24 and grid["h"] >= 1, panel["title"]
        if panel["type"] == "row":
            continue
        assert panel["type"] in {"timeseries", "stat"}
        uid = panel["datasource"]["uid"]
        assert uid.startswith("${") and uid[2:-1] in variables
        refs = [t["refId"] for t in panel["targets"]]
        assert refs and len(refs) == len(set(refs)) and all(t["expr"] for t in panel["targets"])


def test_alert_rules_are_complete_and_query_only_exported_metrics() -> None:
    rules_file = documents(DEPLOY / "prometheus" / "kvmesh-alerts.yaml")[0]
    rules = [r for group in rules_file["groups"] for r in group["rules"]]
    assert rules and len({r["alert"] for r in rules}) == len(rules)
    exported = exported_metric_names()
    for rule in rules:
        assert rule["expr"] and rule["for"] and rule["annotations"]["summary"], rule["alert"]
        assert rule["labels"]["severity"] in {"critical", "warning", "info"}
        named = set(re.findall(r"kvmesh_[a-z0-9_]+", rule["expr"]))
        assert named and named <= exported, f"{rule['alert']}: not exported: {named - exported}"


def test_the_operations_guide_names_only_exported_metrics() -> None:
    text = (ROOT / "docs" / "operations.md").read_text()
    named = set(re.findall(r"`(kvmesh_[a-z0-9_]*[a-z0-9])[`{]", text))
    exported = exported_metric_names(with_histogram_families=True)
    assert len(named) > 10 and named <= exported, f"not exported: {named - exported}"
