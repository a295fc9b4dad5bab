"""deploy/k8s: the kustomize base renders, every object is valid offline, and the parts fit together.

No cluster is needed. ``kubectl kustomize`` renders the base (skipped without kubectl); every
built-in object is checked against the Kubernetes schemas of a pinned version (the
``kubernetes-validate`` package, strict: an unknown field is an error, as the API server's strict
field validation makes it); the KEDA ScaledObject and the ServiceMonitor against the
openAPIV3Schema of their CRDs, vendored in tests/data/keda (README there: where from), made strict
the same way. Then the invariants that no schema knows: the grace periods cover Sluice's drain,
Redis is durable and never evicts, the probes ask routes that exist, every selector selects pods,
the ScaledObject scales the engines on ``sluice_desired_engines``, and the config the pods read
is one that Sluice loads.
"""

from __future__ import annotations

import base64
import copy
import os
import re
import shutil
import signal
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from sluice.cli import build_parser
from sluice.config import Settings, load_settings

ROOT = Path(__file__).resolve().parents[2]
BASE = ROOT / "deploy" / "k8s"
CRDS = ROOT / "tests" / "data" / "keda"
#: the Kubernetes version the objects must be valid for (kubernetes-validate ships its schemas)
KUBERNETES = "1.32.0"
#: the oldest and the newest the docs promise: 1.27 (kubectl's kustomize v5) to what the package knows
KUBERNETES_RANGE = ("1.27.0", KUBERNETES, kubernetes_validate.latest_version())
#: the objects whose schema is a CRD's, not Kubernetes' own: (apiVersion, kind) -> CRD file
CUSTOM = {
    ("keda.sh/v1alpha1", "ScaledObject"): "keda.sh_scaledobjects.yaml",
    ("monitoring.coreos.com/v1", "ServiceMonitor"): "monitoring.coreos.com_servicemonitors.yaml",
}
WORKLOADS = ("Deployment", "StatefulSet")


@pytest.fixture(scope="module")
def objects() -> list[dict[str, Any]]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed (it renders the kustomize base)")
    out = subprocess.run(
        [kubectl, "kustomize", str(BASE)], capture_output=True, text=True, timeout=60, check=False
    )
    assert out.returncode == 0, out.stderr
    return [o for o in yaml.safe_load_all(out.stdout) if o]


def find(objects: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    found = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} found"
    return found[0]


def of_kind(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == kind]


def container(workload: dict[str, Any], name: str) -> dict[str, Any]:
    (found,) = [c for c in workload["spec"]["template"]["spec"]["containers"] if c["name"] == name]
    return dict(found)


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def pod_labels(objects: list[dict[str, Any]]) -> Iterator[tuple[dict[str, Any], dict[str, str]]]:
    for o in objects:
        if o["kind"] in WORKLOADS:
            yield o, o["spec"]["template"]["metadata"]["labels"]


def pre_stop_sleep(c: dict[str, Any]) -> float:
    """Seconds the container's preStop hook sleeps (0 without one)."""
    hook = c.get("lifecycle", {}).get("preStop")
    if hook is None:
        return 0.0
    if "sleep" in hook:
        return float(hook["sleep"]["seconds"])
    command = hook["exec"]["command"]
    assert command[0] == "sleep", f"a preStop that does more than sleep: {command}"
    return float(command[1])


def config_file(objects: list[dict[str, Any]], with_keys: bool) -> str:
    """The sluice.toml a pod reads: the ConfigMap's, and for a gateway the Secret's [[keys]] after it
    (what the gateway's init container writes)."""
    (config_map,) = [
        o for o in of_kind(objects, "ConfigMap") if o["metadata"]["name"].startswith("sluice-config")
    ]
    text = str(config_map["data"]["sluice.toml"])
    if with_keys:
        text += str(find(objects, "Secret", "sluice-keys")["stringData"]["keys.toml"])
    return text


def settings_of(objects: list[dict[str, Any]], tmp_path: Path, with_keys: bool = True) -> Settings:
    path = tmp_path / "sluice.toml"
    path.write_text(config_file(objects, with_keys))
    return load_settings(path, environ={})


# -- schemas -----------------------------------------------------------------------------------


def test_the_base_renders_every_part(objects: list[dict[str, Any]]) -> None:
    kinds = {(o["kind"], o["metadata"]["name"]) for o in objects}
    for expected in [
        ("Deployment", "sluice-gateway"),
        ("Service", "sluice"),
        ("HorizontalPodAutoscaler", "sluice-gateway"),
        ("Deployment", "sluice-worker"),
        ("StatefulSet", "redis"),
        ("Deployment", "vllm"),
        ("Service", "vllm-headless"),
        ("Secret", "sluice-keys"),
        ("ScaledObject", "vllm"),
        ("ServiceMonitor", "sluice"),
    ]:
        assert expected in kinds
    assert any(k == "ConfigMap" and n.startswith("sluice-config-") for k, n in kinds)
    assert {o["metadata"].get("namespace") for o in objects if o["kind"] != "Namespace"} == {"sluice"}


@pytest.mark.parametrize("version", KUBERNETES_RANGE)
def test_every_kubernetes_object_is_valid_for_the_pinned_versions(
    objects: list[dict[str, Any]], version: str
) -> None:
    checked = 0
    for o in objects:
        if (o["apiVersion"], o["kind"]) in CUSTOM:
            continue
        kubernetes_validate.validate(o, version, strict=True)
        checked += 1
    assert checked >= 14


def test_a_misspelt_field_fails_the_kubernetes_validation(objects: list[dict[str, Any]]) -> None:
    """The check above can fail: strict validation refuses a field that does not exist."""
    bad = copy.deepcopy(find(objects, "Deployment", "sluice-gateway"))
    bad["spec"]["template"]["spec"]["terminationGracePeriod"] = 90
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, KUBERNETES, strict=True)


def strict(schema: Any) -> Any:
    """The CRD schema with unknown fields refused wherever it lists the known ones and does not keep
    unknown ones (x-kubernetes-preserve-unknown-fields): what the API server's strict field validation
    does, where JSON Schema would let any extra property through."""
    if isinstance(schema, list):
        return [strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict(v) for k, v in schema.items()}
    if (
        "properties" in out
        and "additionalProperties" not in out
        and not out.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


def crd_validator(api_version: str, kind: str) -> jsonschema.Draft7Validator:
    crd = yaml.safe_load((CRDS / CUSTOM[(api_version, kind)]).read_text())
    assert crd["spec"]["names"]["kind"] == kind
    group, version = api_version.split("/")
    assert crd["spec"]["group"] == group
    (served,) = [v for v in crd["spec"]["versions"] if v["name"] == version]
    assert served["served"]
    schema = strict(served["schema"]["openAPIV3Schema"])
    # metadata is the API server's to check (ObjectMeta), not the CRD's
    schema["properties"]["metadata"] = {"type": "object"}
    return jsonschema.Draft7Validator(schema)


@pytest.mark.parametrize(("api_version", "kind"), sorted(CUSTOM))
def test_custom_resources_match_their_crd(objects: list[dict[str, Any]], api_version: str, kind: str) -> None:
    found = [o for o in objects if o["kind"] == kind]
    assert found, f"no {kind} rendered"
    validator = crd_validator(api_version, kind)
    for o in found:
        assert o["apiVersion"] == api_version
        errors = [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(o)]
        assert not errors, errors


def test_a_misspelt_scaled_object_fails_kedas_schema(objects: list[dict[str, Any]]) -> None:
    bad = copy.deepcopy(find(objects, "ScaledObject", "vllm"))
    bad["spec"]["minReplicas"] = bad["spec"].pop("minReplicaCount")
    validator = crd_validator("keda.sh/v1alpha1", "ScaledObject")
    assert any("minReplicas" in e.message for e in validator.iter_errors(bad))


# -- how the parts fit -------------------------------------------------------------------------


def test_redis_is_durable_and_never_evicts(objects: list[dict[str, Any]]) -> None:
    redis = find(objects, "StatefulSet", "redis")
    args = container(redis, "redis")["args"]
    assert args[0] == "redis-server"
    opts = dict(zip(args[1::2], args[2::2], strict=True))
    assert opts["--appendonly"] == "yes"
    assert opts["--appendfsync"] == "always"
    assert opts["--maxmemory-policy"] == "noeviction"
    # the data directory is the claimed volume, so the AOF outlives the pod
    (claim,) = redis["spec"]["volumeClaimTemplates"]
    mounts = {m["mountPath"]: m["name"] for m in container(redis, "redis")["volumeMounts"]}
    assert mounts[opts["--dir"]] == claim["metadata"]["name"]
    assert redis["spec"]["replicas"] == 1


def test_the_broker_is_the_redis_service(objects: list[dict[str, Any]], tmp_path: Path) -> None:
    settings = settings_of(objects, tmp_path)
    match = re.fullmatch(r"redis://([a-z0-9-]+)\.([a-z0-9-]+)\.svc:(\d+)", settings.broker)
    assert match, settings.broker
    service = find(objects, "Service", match[1])
    assert service["metadata"]["namespace"] == match[2]
    assert int(match[3]) in {p["port"] for p in service["spec"]["ports"]}
    assert selects(
        service["spec"]["selector"],
        find(objects, "StatefulSet", "redis")["spec"]["template"]["metadata"]["labels"],
    )


def test_the_config_the_pods_read_is_one_sluice_loads(objects: list[dict[str, Any]], tmp_path: Path) -> None:
    """The gateway's file (ConfigMap + the Secret's keys) loads, and is never open mode; the worker's
    (the ConfigMap alone) loads too."""
    gateway = settings_of(objects, tmp_path)
    assert gateway.keys, "the gateway would serve without keys"
    assert gateway.host == "0.0.0.0"
    assert not gateway.insecure_open
    ports = {
        p["containerPort"]
        for p in container(find(objects, "Deployment", "sluice-gateway"), "gateway")["ports"]
    }
    assert gateway.port in ports
    worker = settings_of(objects, tmp_path, with_keys=False)
    assert worker.broker == gateway.broker


def run_init_container(objects: list[dict[str, Any]], tmp_path: Path, keys: str) -> tuple[int, str, Path]:
    """The gateway's init container's command, run here: each of its mounts a directory of this test's
    holding what the pod's volume holds (the ConfigMap's and the Secret's files, an empty dir), and
    this venv's python on PATH. Its exit status and output, and where the main container reads."""
    spec = find(objects, "Deployment", "sluice-gateway")["spec"]["template"]["spec"]
    (init,) = spec["initContainers"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    script = init["command"][-1]
    local: dict[str, Path] = {}
    for mount in init["volumeMounts"]:
        directory = tmp_path / mount["name"]
        directory.mkdir()
        volume = volumes[mount["name"]]
        if "configMap" in volume:
            (config_map,) = [
                o
                for o in of_kind(objects, "ConfigMap")
                if o["metadata"]["name"] == volume["configMap"]["name"]
            ]
            for name, text in config_map["data"].items():
                (directory / name).write_text(text)
        elif "secret" in volume:
            assert volume["secret"]["secretName"] == "sluice-keys"
            (directory / "keys.toml").write_text(keys)
        local[mount["mountPath"]] = directory
    for mount_path, directory in sorted(local.items(), key=lambda kv: -len(kv[0])):
        script = script.replace(mount_path + "/", f"{directory}/")
    out = subprocess.run(
        [*init["command"][:-1], script],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"},
    )
    # where the gateway reads its config: the same emptyDir, mounted in both
    gateway = container(find(objects, "Deployment", "sluice-gateway"), "gateway")
    config_path = build_parser("gateway").parse_args(gateway["args"]).config
    (mount,) = [m for m in gateway["volumeMounts"] if config_path.startswith(m["mountPath"] + "/")]
    assert "emptyDir" in volumes[mount["name"]]
    written = local[mount["mountPath"]] / config_path[len(mount["mountPath"]) + 1 :]
    return out.returncode, out.stdout + out.stderr, written


def test_the_init_container_writes_the_config_the_gateway_reads(
    objects: list[dict[str, Any]], tmp_path: Path
) -> None:
    keys = str(find(objects, "Secret", "sluice-keys")["stringData"]["keys.toml"])
    code, output, written = run_init_container(objects, tmp_path, keys)
    assert code == 0, output
    assert written.read_text() == config_file(objects, with_keys=True)
    assert load_settings(written, environ={}).keys


def test_the_init_container_stops_a_bad_config_with_its_message(
    objects: list[dict[str, Any]], tmp_path: Path
) -> None:
    """A Secret with something else than [[keys]] (here a misspelt field) stops the pod before it
    starts, with Sluice's message."""
    keys = '[[keys]]\ntenant = "a"\nkey_sha = "' + "0" * 64 + '"\n'
    code, output, _ = run_init_container(objects, tmp_path, keys)
    assert code != 0
    assert "keys.0.key_sha" in output


def test_the_secret_holds_only_keys_tables(objects: list[dict[str, Any]]) -> None:
    """It is appended to sluice.toml: a top-level setting in it would land in the file's last table."""
    fragment = tomllib.loads(str(find(objects, "Secret", "sluice-keys")["stringData"]["keys.toml"]))
    assert list(fragment) == ["keys"]
    base = config_file(objects, with_keys=False)
    last_line = [line for line in base.splitlines() if line.strip() and not line.startswith("#")][-1]
    assert not re.match(r"^\s*\[\[keys\]\]", last_line)


@pytest.mark.parametrize(("name", "role"), [("sluice-gateway", "gateway"), ("sluice-worker", "worker")])
def test_the_containers_run_a_sluice_role(objects: list[dict[str, Any]], name: str, role: str) -> None:
    workload = find(objects, "Deployment", name)
    args = container(workload, role)["args"]
    assert args[0] == role
    parsed = build_parser(role).parse_args(args)
    mounts = [m["mountPath"] for m in container(workload, role)["volumeMounts"]]
    assert any(parsed.config.startswith(m + "/") for m in mounts), (parsed.config, mounts)


def test_probes_ask_routes_the_gateway_serves(objects: list[dict[str, Any]]) -> None:
    from sluice.api.health import router

    routes = {getattr(r, "path", None) for r in router.routes}
    gateway = container(find(objects, "Deployment", "sluice-gateway"), "gateway")
    assert gateway["livenessProbe"]["httpGet"]["path"] in routes
    assert gateway["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert "/readyz" in routes
    for probe in ("livenessProbe", "readinessProbe"):
        assert gateway[probe]["httpGet"]["port"] in {p["name"] for p in gateway["ports"]}
    engine = container(find(objects, "Deployment", "vllm"), "vllm")
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert engine[probe]["httpGet"]["path"] == "/health"
    # a cold start (image pull, weights, CUDA graphs) takes minutes: the startup probe waits for it
    startup = engine["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600


def pod_env(workload: dict[str, Any], role: str) -> dict[str, str]:
    """The container's environment given as values (those from a Secret are the cluster's)."""
    return {v["name"]: v["value"] for v in container(workload, role).get("env", []) if "value" in v}


def drain_grace(
    objects: list[dict[str, Any]],
    workload: dict[str, Any],
    role: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> float:
    """Sluice's drain in this pod, as the role reads it (sluice.drain: from the pod's config file and
    environment, else the default): how long a draining process may take from SIGTERM to its exit,
    less the cut-off."""
    from sluice import drain
    from sluice.roles.http import ACCEPT_ENV, accept_of

    c = container(workload, role)
    build_parser(role).parse_args(c["args"])
    for name in (drain.GRACE_ENV, ACCEPT_ENV):
        monkeypatch.delenv(name, raising=False)
    for name, value in pod_env(workload, role).items():
        monkeypatch.setenv(name, value)
    path = tmp_path / f"{role}.toml"
    path.write_text(config_file(objects, with_keys=role == "gateway"))
    settings = load_settings(path)
    grace = drain.grace_of(settings)
    if role == "gateway":
        # new requests still taken after SIGTERM, before the grace of the last one starts
        grace += accept_of(settings)
    return grace


def test_grace_periods_cover_the_drain(
    objects: list[dict[str, Any]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Kubernetes counts the preStop hook inside terminationGracePeriodSeconds, then SIGKILLs: the pod's
    grace must exceed preStop + Sluice's own drain grace, or a drain is cut short."""
    for name, role in [("sluice-gateway", "gateway"), ("sluice-worker", "worker")]:
        workload = find(objects, "Deployment", name)
        grace = drain_grace(objects, workload, role, tmp_path, monkeypatch)
        # the pod sets its grace; the process reads that one, not the default
        env = pod_env(workload, role)
        assert grace >= float(env["SLUICE_DRAIN_GRACE_S"]) > 0, name
        pod_grace = workload["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        # a margin for the exit itself (handing jobs back, closing connections) after the grace
        assert pod_grace >= pre_stop_sleep(container(workload, role)) + grace + 10, name
    # the gateway keeps serving while its endpoint removal spreads; a worker has no clients to wait for
    assert pre_stop_sleep(container(find(objects, "Deployment", "sluice-gateway"), "gateway")) > 0
    engine = find(objects, "Deployment", "vllm")
    assert engine["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > pre_stop_sleep(
        container(engine, "vllm")
    )


def test_the_docs_table_of_terminations_is_the_bases(objects: list[dict[str, Any]]) -> None:
    """docs/kubernetes.md's table (preStop, drain grace, terminationGracePeriodSeconds per pod) says
    what the manifests set."""
    rows = {
        "gateway": (find(objects, "Deployment", "sluice-gateway"), "gateway"),
        "worker": (find(objects, "Deployment", "sluice-worker"), "worker"),
        "vLLM": (find(objects, "Deployment", "vllm"), "vllm"),
        "Redis": (find(objects, "StatefulSet", "redis"), "redis"),
    }
    text = (ROOT / "docs" / "kubernetes.md").read_text()

    def seconds(cell: str) -> float:
        found = re.match(r"\s*(\d+) s\b", cell)
        return float(found[1]) if found else 0.0

    for pod, (workload, role) in rows.items():
        (line,) = [line for line in text.splitlines() if line.startswith(f"| {pod} |")]
        _, _, _, pre_stop, grace, pod_grace, _ = line.split("|")
        c = container(workload, role)
        assert seconds(pre_stop) == pre_stop_sleep(c), pod
        env = pod_env(workload, role)
        assert seconds(grace) == float(env.get("SLUICE_DRAIN_GRACE_S", 0)), pod
        assert seconds(pod_grace) == workload["spec"]["template"]["spec"]["terminationGracePeriodSeconds"], (
            pod
        )


def test_a_leaving_engine_is_out_of_the_pool_before_it_stops(
    objects: list[dict[str, Any]], tmp_path: Path
) -> None:
    """A terminating vLLM pod leaves the headless Service's DNS at once; the workers see it gone at
    their next resolution, through CoreDNS's cache (30 s at most in its default Corefile). The
    preStop sleep keeps vLLM serving until then, so no new work is sent to an engine that stopped."""
    refresh = settings_of(objects, tmp_path).dns_refresh_s
    assert pre_stop_sleep(container(find(objects, "Deployment", "vllm"), "vllm")) > refresh + 30


def test_services_select_pods_and_their_ports(objects: list[dict[str, Any]]) -> None:
    for service in of_kind(objects, "Service"):
        matched = [
            (w, labels) for w, labels in pod_labels(objects) if selects(service["spec"]["selector"], labels)
        ]
        assert matched, f"Service {service['metadata']['name']} selects no pods"
        for workload, _ in matched:
            names = {
                p["name"]
                for c in workload["spec"]["template"]["spec"]["containers"]
                for p in c.get("ports", [])
            }
            for port in service["spec"]["ports"]:
                assert port["targetPort"] in names, (service["metadata"]["name"], port)


def test_disruption_budgets_select_existing_pods(objects: list[dict[str, Any]]) -> None:
    budgets = of_kind(objects, "PodDisruptionBudget")
    covered = set()
    for pdb in budgets:
        matched = [
            w["metadata"]["name"]
            for w, labels in pod_labels(objects)
            if selects(pdb["spec"]["selector"]["matchLabels"], labels)
        ]
        assert len(matched) == 1, (pdb["metadata"]["name"], matched)
        covered.add(matched[0])
    # every workload that runs more than one pod keeps some through a node drain
    assert {"sluice-gateway", "vllm"} <= covered
    for pdb in budgets:
        if "minAvailable" in pdb["spec"]:
            name = pdb["metadata"]["name"]
            least = (
                find(objects, "HorizontalPodAutoscaler", name)["spec"]["minReplicas"]
                if name == "sluice-gateway"
                else find(objects, "Deployment", name)["spec"]["replicas"]
            )
            # a budget that asks for every pod would block node drains for ever
            assert pdb["spec"]["minAvailable"] < least, name


def test_workloads_select_their_own_pods(objects: list[dict[str, Any]]) -> None:
    for workload, labels in pod_labels(objects):
        assert selects(workload["spec"]["selector"]["matchLabels"], labels), workload["metadata"]["name"]


def test_the_hpa_scales_the_gateways_on_cpu(objects: list[dict[str, Any]]) -> None:
    hpa = find(objects, "HorizontalPodAutoscaler", "sluice-gateway")
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", "sluice-gateway")
    assert [m["resource"]["name"] for m in hpa["spec"]["metrics"]] == ["cpu"]
    gateway = container(find(objects, "Deployment", "sluice-gateway"), "gateway")
    assert "cpu" in gateway["resources"]["requests"], "utilization is a fraction of the request"
    # the autoscalers own the counts: a manifest replica count would reset them at each apply
    assert "replicas" not in find(objects, "Deployment", "sluice-gateway")["spec"]
    assert "replicas" not in find(objects, "Deployment", "vllm")["spec"]


def test_the_scaled_object_scales_the_engines_on_desired_engines(
    objects: list[dict[str, Any]], tmp_path: Path
) -> None:
    scaled = find(objects, "ScaledObject", "vllm")
    target = scaled["spec"]["scaleTargetRef"]
    assert (target.get("kind", "Deployment"), target["name"]) == ("Deployment", "vllm")
    find(objects, "Deployment", "vllm")
    (trigger,) = scaled["spec"]["triggers"]
    assert trigger["type"] == "prometheus"
    query = trigger["metadata"]["query"]
    assert re.search(r"\bsluice_desired_engines\b", query)
    # every gateway serves the same fleet-wide value: summing them would multiply the engines
    assert query.startswith("max(") or query.startswith("max by")
    # replicas = ceil(value / threshold): the value is a number of engines
    assert trigger["metricType"] == "AverageValue"
    assert float(trigger["metadata"]["threshold"]) == 1
    assert scaled["spec"]["minReplicaCount"] >= 1
    # up at least as fast as docs/autoscaling.md simulated (the HPA's default: 4 pods or 100 % per 15 s)
    up = scaled["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]["scaleUp"]
    assert up["stabilizationWindowSeconds"] == 0
    assert up.get("selectPolicy", "Max") == "Max"
    rates = {(p["type"], p["value"], p["periodSeconds"]) for p in up["policies"]}
    assert ("Pods", 4, 15) in rates and ("Percent", 100, 15) in rates
    # the model (or pool) it asks about is served by the pool whose engines are this Deployment's pods
    matchers = dict(re.findall(r'(\w+)="([^"]+)"', query))
    assert set(matchers) & {"model", "pool"}, query
    headless = find(objects, "Service", "vllm-headless")
    assert headless["spec"]["clusterIP"] == "None"
    assert not headless["spec"].get("publishNotReadyAddresses", False)
    port = headless["spec"]["ports"][0]["port"]
    pools = [
        p
        for p in settings_of(objects, tmp_path).pools
        if f"dns://vllm-headless.sluice.svc:{port}" in p.engines
    ]
    assert len(pools) == 1, "one pool has the vLLM pods as its engines"
    if "pool" in matchers:
        assert matchers["pool"] == pools[0].name
    if "model" in matchers:
        assert matchers["model"] in pools[0].models
        # the model's need is this pool's only if no other pool serves the model too
        serving = [p.name for p in settings_of(objects, tmp_path).pools if matchers["model"] in p.models]
        assert serving == [pools[0].name], serving
    vllm = container(find(objects, "Deployment", "vllm"), "vllm")
    served = vllm["args"][vllm["args"].index("--served-model-name") + 1]
    assert pools[0].models == [served], "the pool lists the model the engines serve, by its served name"
    assert selects(
        headless["spec"]["selector"],
        find(objects, "Deployment", "vllm")["spec"]["template"]["metadata"]["labels"],
    )


#: the trigger metadata KEDA's Prometheus scaler reads (pkg/scalers/prometheus_scaler.go at the
#: commit of tests/data/keda's CRD): the CRD types metadata as any strings, so a misspelt key would
#: pass its schema and be ignored
PROMETHEUS_SCALER_KEYS = {
    "serverAddress",
    "query",
    "queryParameters",
    "threshold",
    "activationThreshold",
    "namespace",
    "customHeaders",
    "ignoreNullValues",
    "unsafeSsl",
    "awsRegion",
    "timeout",
    "identityOwner",
}


def test_the_trigger_says_only_what_kedas_prometheus_scaler_reads(objects: list[dict[str, Any]]) -> None:
    (trigger,) = find(objects, "ScaledObject", "vllm")["spec"]["triggers"]
    metadata = trigger["metadata"]
    assert set(metadata) <= PROMETHEUS_SCALER_KEYS, set(metadata) - PROMETHEUS_SCALER_KEYS
    assert {"serverAddress", "query", "threshold"} <= set(metadata)
    if "fallback" in find(objects, "ScaledObject", "vllm")["spec"]:
        # a missing metric must be an error, for the fallback to apply, not a 0 (KEDA's default)
        assert metadata["ignoreNullValues"] == "false"


@pytest.mark.skipif(
    shutil.which("promtool") is None, reason="promtool (Debian's prometheus) is not installed"
)
def test_the_query_counts_engines_once_over_many_gateways(
    objects: list[dict[str, Any]], tmp_path: Path
) -> None:
    """promtool evaluates the ScaledObject's query on the series Prometheus would hold: two gateways
    serving the same fleet-wide value for the pool's model, and another model's; the answer is that
    value, once (a sum would double the engines; another model's must not count)."""
    query = find(objects, "ScaledObject", "vllm")["spec"]["triggers"][0]["metadata"]["query"]
    model = dict(re.findall(r'(\w+)="([^"]+)"', query))["model"]
    series = [
        (f'sluice_desired_engines{{model="{model}", instance="10.0.0.1:8000"}}', "3x8"),
        (f'sluice_desired_engines{{model="{model}", instance="10.0.0.2:8000"}}', "3x8"),
        ('sluice_desired_engines{model="another", instance="10.0.0.1:8000"}', "7x8"),
    ]
    spec = {
        "rule_files": [],
        "evaluation_interval": "15s",
        "tests": [
            {
                "interval": "15s",
                "input_series": [{"series": name, "values": values} for name, values in series],
                "promql_expr_test": [
                    {"expr": query, "eval_time": "1m", "exp_samples": [{"labels": "{}", "value": 3}]}
                ],
            }
        ],
    }
    (tmp_path / "query_test.yml").write_text(yaml.safe_dump(spec))
    done = subprocess.run(
        ["promtool", "test", "rules", "query_test.yml"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_metric_it_scales_on_is_one_sluice_exports() -> None:
    from sluice.metrics import Metrics

    names = {m.name for m in Metrics().registry.collect()}
    assert "sluice_desired_engines" in names


def test_the_service_monitor_scrapes_the_gateways(objects: list[dict[str, Any]], tmp_path: Path) -> None:
    monitor = find(objects, "ServiceMonitor", "sluice")
    service = find(objects, "Service", "sluice")
    assert selects(monitor["spec"]["selector"]["matchLabels"], service["metadata"]["labels"])
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}
    assert endpoint["path"] == "/metrics"
    # Prometheus sends no key: /metrics must be public, or the ServiceMonitor must carry one
    assert settings_of(objects, tmp_path).metrics_public or "authorization" in endpoint


def test_the_overlay_the_docs_describe_replaces_the_image_and_the_keys(tmp_path: Path) -> None:
    """docs/kubernetes.md, step 3: an overlay names the image and replaces the placeholder keys; the
    gateway then reads a config with those keys and no other."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed (it renders the kustomize base)")
    overlay = tmp_path / "my-sluice"
    overlay.mkdir()
    keys = '[[keys]]\ntenant = "team-a"\nadmin = true\nkey_sha256 = "' + "ab" * 32 + '"\n'
    (overlay / "keys.toml").write_text(keys)
    (overlay / "dashboard-session-secret").write_text("0123456789abcdef" * 4)
    (overlay / "kustomization.yaml").write_text(
        yaml.safe_dump(
            {
                "apiVersion": "kustomize.config.k8s.io/v1beta1",
                "kind": "Kustomization",
                "resources": [os.path.relpath(BASE, overlay)],
                "images": [{"name": "sluice", "newName": "example.org/team/sluice", "newTag": "0.1.0"}],
                "secretGenerator": [
                    {
                        "name": "sluice-keys",
                        "behavior": "replace",
                        "files": ["keys.toml", "dashboard-session-secret"],
                    }
                ],
            }
        )
    )
    out = subprocess.run(
        [kubectl, "kustomize", str(overlay)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    rendered = [o for o in yaml.safe_load_all(out.stdout) if o]
    secret = find(rendered, "Secret", "sluice-keys")
    assert base64.b64decode(secret["data"]["keys.toml"]).decode() == keys
    # the gateways' environment takes the session secret from the key of that name
    gateway_env = find(rendered, "Deployment", "sluice-gateway")["spec"]["template"]["spec"]["containers"][0][
        "env"
    ]
    (session,) = [v for v in gateway_env if v["name"] == "SLUICE_DASHBOARD_SESSION_SECRET"]
    assert session["valueFrom"]["secretKeyRef"]["key"] in secret["data"]
    assert session["valueFrom"]["secretKeyRef"]["name"] == "sluice-keys"
    gateway = find(rendered, "Deployment", "sluice-gateway")["spec"]["template"]["spec"]
    assert gateway["containers"][0]["image"] == "example.org/team/sluice:0.1.0"
    assert {v["secret"]["secretName"] for v in gateway["volumes"] if "secret" in v} == {"sluice-keys"}
    secret["stringData"] = {"keys.toml": keys}
    settings = settings_of(rendered, tmp_path)
    assert [k.tenant for k in settings.keys] == ["team-a"]


# -- the image ---------------------------------------------------------------------------------


def dockerfile() -> list[tuple[str, str]]:
    """The Dockerfile's instructions as (INSTRUCTION, arguments), continuation lines joined."""
    text = re.sub(r"\\\n", " ", (ROOT / "Dockerfile").read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def test_the_dockerfile_builds_the_package_as_a_user(objects: list[dict[str, Any]]) -> None:
    steps = dockerfile()
    froms = [args for word, args in steps if word == "FROM"]
    assert froms and froms[-1].split()[0] == "python:3.11-slim"
    runs = " ".join(args for word, args in steps if word == "RUN")
    assert re.search(r"\bpip install\b", runs)
    assert "[dev]" not in runs and "-e " not in runs
    (user,) = [args for word, args in steps if word == "USER"]
    uid = user.split(":")[0]
    assert uid.isdigit() and int(uid) != 0, "a numeric non-root uid, so runAsNonRoot can check it"
    for name in ("sluice-gateway", "sluice-worker"):
        security = find(objects, "Deployment", name)["spec"]["template"]["spec"]["securityContext"]
        assert security["runAsNonRoot"] and security["runAsUser"] == int(uid)
    (entry,) = [args for word, args in steps if word == "ENTRYPOINT"]
    assert entry == '["sluice"]', "exec form: the process gets SIGTERM itself (the drain)"


def test_the_dockerfile_copies_only_what_exists_and_is_sent() -> None:
    ignore = [
        line
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line and not line.startswith("#")
    ]
    assert ignore[0] == "*", ".dockerignore sends only what it lists"
    sent = {line[1:].rstrip("/") for line in ignore if line.startswith("!")}
    for word, args in dockerfile():
        if word == "COPY" and "--from" not in args:
            *sources, _dest = args.split()
            for source in sources:
                assert (ROOT / source).exists(), source
                assert source.rstrip("/") in sent, f"{source} is not in the build context"
    # what the build needs: the project file, the readme it names, the package
    assert {"pyproject.toml", "README.md", "src"} <= sent


def test_the_pods_run_the_image_the_base_names(objects: list[dict[str, Any]]) -> None:
    kustomization = yaml.safe_load((BASE / "kustomization.yaml").read_text())
    (image,) = [i for i in kustomization["images"] if i["name"] == "sluice"]
    expected = f"{image.get('newName', 'sluice')}:{image['newTag']}"
    for name in ("sluice-gateway", "sluice-worker"):
        spec = find(objects, "Deployment", name)["spec"]["template"]["spec"]
        for c in [*spec["containers"], *spec.get("initContainers", [])]:
            assert c["image"] == expected


# -- the config, run ---------------------------------------------------------------------------


def local_config(objects: list[dict[str, Any]], broker: str, port: int, engine_port: int, key: str) -> str:
    """The gateway's sluice.toml as the pod gets it, moved onto this machine: the broker, the listening
    address and the pool's DNS name are the only lines changed, and a real key replaces the Secret's
    placeholder (an init container would append that Secret in the same place)."""
    from sluice.api.auth import hash_key

    text = config_file(objects, with_keys=False)
    replaced = {
        r'^broker = ".*"$': f'broker = "{broker}"',
        r'^host = ".*"$': 'host = "127.0.0.1"',
        r"^port = \d+$": f"port = {port}",
        r"dns://vllm-headless\.sluice\.svc:\d+": f"dns://127.0.0.1:{engine_port}",
    }
    for pattern, line in replaced.items():
        text, n = re.subn(pattern, line, text, flags=re.MULTILINE)
        assert n == 1, pattern
    return text + f'[[keys]]\ntenant = "test"\nkey_sha256 = "{hash_key(key)}"\n'


@pytest.mark.slow
async def test_the_pods_commands_serve_a_request_and_drain(
    objects: list[dict[str, Any]], tmp_path: Path
) -> None:
    """The gateway and worker pods' commands, run here with their config and environment (only the
    addresses moved onto loopback; a simulator in vLLM's place, found through the pool's dns://
    engine): the probes answer, a request through the OpenAI SDK is served, and on SIGTERM both exit
    within their terminationGracePeriodSeconds."""
    import httpx
    from openai import AsyncOpenAI

    from tests.failures.procs import Proc
    from tests.helpers import free_port, wait_until
    from tests.redis_server import RedisServer

    gateway_pod = find(objects, "Deployment", "sluice-gateway")
    worker_pod = find(objects, "Deployment", "sluice-worker")
    engine = container(find(objects, "Deployment", "vllm"), "vllm")
    model = engine["args"][engine["args"].index("--served-model-name") + 1]
    probes = container(gateway_pod, "gateway")
    live, ready = probes["livenessProbe"]["httpGet"]["path"], probes["readinessProbe"]["httpGet"]["path"]

    key = "sk-sluice-deploy-test"
    port, engine_port = free_port(), free_port()
    procs: list[Proc] = []
    with RedisServer(aof=True) as redis:
        config = tmp_path / "sluice.toml"
        config.write_text(local_config(objects, redis.url, port, engine_port, key))
        try:
            procs.append(Proc(["sim", "--port", str(engine_port), "--model", model, "--preset", "fast"]))
            # the containers' args, with the config file where this test put it
            worker_args = [
                str(config) if a.endswith("sluice.toml") else a
                for a in container(worker_pod, "worker")["args"]
            ]
            gateway_args = [str(config) if a.endswith("sluice.toml") else a for a in probes["args"]]
            worker = Proc(worker_args, pod_env(worker_pod, "worker"))
            gateway = Proc(gateway_args, pod_env(gateway_pod, "gateway"))
            procs += [worker, gateway]
            url = f"http://127.0.0.1:{port}"

            async def answers(path: str) -> bool:
                assert worker.alive, worker.output()
                assert gateway.alive, gateway.output()
                try:
                    async with httpx.AsyncClient() as c:
                        return (await c.get(url + path, timeout=2)).status_code == 200
                except httpx.HTTPError:
                    return False

            await wait_until(lambda: answers(live), timeout=30)
            await wait_until(lambda: answers(ready), timeout=30)

            client = AsyncOpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=30)
            reply = await client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=8
            )
            await client.close()
            assert reply.choices[0].message.content
            assert reply.usage is not None and reply.usage.completion_tokens > 0

            # the worker exits 0 once drained; the gateway's server re-raises the SIGTERM it handled
            # once it is done (uvicorn does), an exit Kubernetes expects of a pod it stops
            for proc, pod, ok in [(gateway, gateway_pod, {0, -signal.SIGTERM}), (worker, worker_pod, {0})]:
                proc.popen.terminate()
                grace = pod["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
                assert proc.popen.wait(grace) in ok, proc.output()
        finally:
            for proc in procs:
                proc.stop()
