"""deploy/kubernetes: each overlay builds with `kubectl kustomize`, every object passes
kubernetes-validate's strict schema check, and the objects agree with each other and with
the code: Services and budgets select the pods they mean, probes hit paths the processes
serve, every variable set is one the code reads, every secret or config key is documented,
pods run as the security rules below say, and the workers serve exactly the lanes
platform/atrium/lanes.py defines (docs/deploy.md)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import urllib.error
import urllib.request
from functools import cache
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from atrium.lanes import ALL_QUEUES, LANES
from engine import protocol

ROOT = Path(__file__).resolve().parents[2]
KUSTOMIZE = ROOT / "deploy" / "kubernetes"
OVERLAYS = ("dev", "prod")
KUBERNETES_VERSION = "1.32.0"
# The custom resources KEDA defines: not in Kubernetes' schemas, checked by hand below.
CUSTOM = {"keda.sh/v1alpha1"}
# Where the processes read their environment.
SOURCES = [ROOT / d for d in ("platform", "engine", "core", "inference", "billing", "batches",
                              "adapters", "tenants", "webui", "requestlogs", "redaction")]


@cache
def build(overlay: str) -> tuple[dict[str, Any], ...]:
    kubectl = shutil.which("kubectl")
    assert kubectl, "kubectl is needed to build the manifests (README: requirements)"
    out = subprocess.run([kubectl, "kustomize", str(KUSTOMIZE / "overlays" / overlay)],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    return tuple(doc for doc in yaml.safe_load_all(out) if doc)


def of_kind(overlay: str, kind: str) -> list[dict[str, Any]]:
    return [o for o in build(overlay) if o["kind"] == kind]


def named(overlay: str, kind: str, name: str) -> dict[str, Any]:
    [found] = [o for o in of_kind(overlay, kind) if o["metadata"]["name"] == name]
    return found


def pod_templates(overlay: str) -> list[tuple[str, dict[str, Any]]]:
    """(workload name, pod template) of every Deployment and Job."""
    return [(o["metadata"]["name"], o["spec"]["template"]) for o in build(overlay)
            if o["kind"] in ("Deployment", "Job")]


def containers(overlay: str) -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
    return [(name, t["spec"], c) for name, t in pod_templates(overlay)
            for c in t["spec"]["containers"]]


def atrium_containers(overlay: str):
    return [(n, s, c) for n, s, c in containers(overlay) if n.startswith("atrium-")]


def config(overlay: str) -> dict[str, str]:
    return named(overlay, "ConfigMap", "atrium-config")["data"]


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return selector.items() <= labels.items()


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_each_overlay_builds_every_part(overlay):
    kinds = {(o["kind"], o["metadata"]["name"]) for o in build(overlay)}
    for part in [("Deployment", "atrium-web"), ("Deployment", "atrium-engine"),
                 ("Deployment", "atrium-worker"), ("Deployment", "atrium-worker-outbound"),
                 ("Deployment", "atrium-worker-jobs"), ("Deployment", "atrium-worker-batches"),
                 ("PodDisruptionBudget", "atrium-worker"),
                 ("PodDisruptionBudget", "atrium-worker-outbound"),
                 ("PodDisruptionBudget", "atrium-worker-jobs"),
                 ("PodDisruptionBudget", "atrium-worker-batches"),
                 ("Service", "atrium-worker"), ("Deployment", "atrium-beat"),
                 ("Job", "atrium-migrate"), ("Service", "atrium-web"),
                 ("Ingress", "atrium"), ("HorizontalPodAutoscaler", "atrium-web"),
                 ("PodDisruptionBudget", "atrium-web"), ("NetworkPolicy", "atrium-engine"),
                 ("ConfigMap", "atrium-config")]:
        assert part in kinds, part
    assert all(o["metadata"].get("namespace") == f"atrium{'-dev' if overlay == 'dev' else ''}"
               for o in build(overlay) if o["kind"] != "Namespace")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_kubernetes_validate_accepts_every_object_strictly(overlay):
    checked = 0
    for obj in build(overlay):
        if obj["apiVersion"] in CUSTOM:
            continue
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
        checked += 1
    assert checked >= 20


def test_strict_validation_refuses_a_misspelt_field():
    deployment = named("prod", "Deployment", "atrium-web")
    broken = yaml.safe_load(yaml.safe_dump(deployment))
    broken["spec"]["template"]["spec"]["containers"][0]["readinessProbes"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSION, strict=True)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_services_budgets_and_autoscalers_find_their_pods(overlay):
    templates = pod_templates(overlay)
    for service in of_kind(overlay, "Service"):
        selector = service["spec"]["selector"]
        pods = [t for _, t in templates if selects(selector, t["metadata"]["labels"])]
        assert pods, f"Service {service['metadata']['name']} selects no pod"
        ports = {p["name"] for t in pods for c in t["spec"]["containers"]
                 for p in c.get("ports", [])}
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in ports, (service["metadata"]["name"], port)
    for budget in of_kind(overlay, "PodDisruptionBudget"):
        selector = budget["spec"]["selector"]["matchLabels"]
        assert any(selects(selector, t["metadata"]["labels"]) for _, t in templates), \
            budget["metadata"]["name"]
    deployments = {d["metadata"]["name"] for d in of_kind(overlay, "Deployment")}
    for hpa in of_kind(overlay, "HorizontalPodAutoscaler"):
        assert hpa["spec"]["scaleTargetRef"]["name"] in deployments
    for ingress in of_kind(overlay, "Ingress"):
        for rule in ingress["spec"]["rules"]:
            for route in rule["http"]["paths"]:
                backend = route["backend"]["service"]
                service = named(overlay, "Service", backend["name"])
                assert backend["port"]["name"] in {p["name"] for p in service["spec"]["ports"]}
            assert not any(r["path"].startswith("/internal") for r in rule["http"]["paths"])


def _probes(overlay: str, workload: str) -> dict[str, str]:
    [(_, _, container)] = [(n, s, c) for n, s, c in containers(overlay) if n == workload]
    return {kind: container[kind]["httpGet"]["path"]
            for kind in ("startupProbe", "livenessProbe", "readinessProbe") if kind in container}


@pytest.mark.django_db
def test_the_web_probes_are_paths_the_web_process_answers(client):
    probes = _probes("prod", "atrium-web")
    assert set(probes.values()) == {"/livez", "/readyz"}
    for path in set(probes.values()):
        assert client.get(path).status_code in (200, 503), path  # answered, not 404


def test_the_engine_probes_are_paths_the_engine_answers():
    from engine.metrics_server import serve_metrics

    probes = _probes("prod", "atrium-engine")
    assert probes["readinessProbe"] == "/readyz" and probes["livenessProbe"] == "/livez"
    server = serve_metrics(lambda: None, lambda: (True, True), port=0, model_name="m",
                           engine="e")
    try:
        for path in set(probes.values()):
            url = f"http://127.0.0.1:{server.server_address[1]}{path}"
            with urllib.request.urlopen(url, timeout=5) as reply:
                assert reply.status == 200, path
    finally:
        server.shutdown()
        server.server_close()


def test_the_worker_probe_is_its_metrics_endpoint():
    from core.metrics import serve

    [path] = set(_probes("prod", "atrium-worker").values())
    port = serve(0, what="test")
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as reply:
        assert reply.status == 200 and b"# HELP" in reply.read()


@cache
def _source_text() -> str:
    return "\n".join(p.read_text() for d in SOURCES for p in d.rglob("*.py"))


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_variable_set_is_one_the_code_reads(overlay):
    names = set(config(overlay))
    for _, _, container in atrium_containers(overlay):
        names |= {e["name"] for e in container.get("env", [])}
    source = _source_text()
    unread = sorted(n for n in names if not re.search(rf"[\"']{re.escape(n)}[\"']", source))
    assert not unread, f"set in the manifests, read nowhere: {unread}"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_secret_and_config_key_is_documented(overlay):
    doc = (ROOT / "docs" / "deploy.md").read_text()
    keys = set(config(overlay))
    built = {s["metadata"]["name"]: s["data"] for s in of_kind(overlay, "Secret")}
    for _, _, container in atrium_containers(overlay):
        for env in container.get("env", []):
            ref = env.get("valueFrom", {}).get("secretKeyRef")
            if ref:
                assert ref["name"].startswith("atrium-secrets")
                if ref["name"] in built and not ref.get("optional"):  # generated (dev)
                    assert ref["key"] in built[ref["name"]], ref
                keys.add(ref["key"])
    for auth in of_kind(overlay, "TriggerAuthentication"):
        keys |= {ref["key"] for ref in auth["spec"]["secretTargetRef"]}
    missing = sorted(k for k in keys if f"`{k}`" not in doc)
    assert not missing, f"not in docs/deploy.md: {missing}"


# Stand-ins for the Secret's values: the settings check their form, not their truth.
PLACEHOLDERS = {"DATABASE_URL": "postgres://atrium@db.invalid:5432/atrium",
                "REDIS_URL": "redis://redis.invalid:6379/0"}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_process_starts_its_settings_with_exactly_its_pods_environment(overlay,
                                                                             tmp_path):
    """What each container is given (the ConfigMap, its variables, the Secret's keys it
    references) is enough for the platform's settings: production refuses to start
    without a secret key, allowed hosts, Redis."""
    import os
    import sys

    for name, _, container in atrium_containers(overlay):
        env = {"PATH": os.environ["PATH"], "PYTHONPATH": os.pathsep.join(sys.path),
               "DJANGO_SETTINGS_MODULE": "atrium.settings", **config(overlay)}
        for var in container.get("env", []):
            if "value" in var:
                env[var["name"]] = var["value"]
            elif not var["valueFrom"].get("secretKeyRef", {}).get("optional"):
                env[var["name"]] = PLACEHOLDERS.get(var["name"], "placeholder-" + "x" * 40)
        env["ATRIUM_HOME"] = str(tmp_path / name)  # the pod's /data
        done = subprocess.run([sys.executable, "-c", "import django; django.setup()"],
                              env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, (name, done.stderr[-2000:])


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_pods_run_unprivileged_on_a_read_only_root(overlay):
    for name, spec, container in containers(overlay):
        assert spec["securityContext"]["runAsNonRoot"] is True, name
        assert spec["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault", name
        context = container["securityContext"]
        assert context["readOnlyRootFilesystem"] is True, name
        assert context["allowPrivilegeEscalation"] is False, name
        assert context["capabilities"]["drop"] == ["ALL"], name
        assert spec["automountServiceAccountToken"] is False, name
        assert "resources" in container and "memory" in container["resources"]["limits"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_secrets_are_referenced_never_written_into_pods(overlay):
    for name, _, container in atrium_containers(overlay):
        for env in container.get("env", []):
            assert not re.search(r"SECRET|TOKEN|PASSWORD|DATABASE_URL|REDIS_URL",
                                 env["name"]) or "valueFrom" in env, (name, env["name"])
    if overlay == "prod":  # created in the namespace beforehand, by the operator
        assert not of_kind(overlay, "Secret")


def test_the_engine_drains_within_its_grace_period_and_runs_on_a_gpu():
    engine = named("prod", "Deployment", "atrium-engine")["spec"]["template"]["spec"]
    [container] = engine["containers"]
    drain = float(config("prod")["ATRIUM_DRAIN_S"])
    pause = float(container["lifecycle"]["preStop"]["exec"]["command"][1])
    assert engine["terminationGracePeriodSeconds"] > drain + pause
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert engine["nodeSelector"] and engine["tolerations"]
    assert "/models" in {m["mountPath"] for m in container["volumeMounts"]}
    dev = named("dev", "Deployment", "atrium-engine")["spec"]["template"]["spec"]
    assert "nvidia.com/gpu" not in str(dev)  # development engines run on the CPU


def test_web_outlasts_its_streams_and_beat_never_runs_twice():
    web = named("prod", "Deployment", "atrium-web")["spec"]["template"]["spec"]
    pause = float(web["containers"][0]["lifecycle"]["preStop"]["exec"]["command"][1])
    assert web["terminationGracePeriodSeconds"] >= \
        pause + float(config("prod")["ATRIUM_REQUEST_TIMEOUT_S"])
    beat = named("prod", "Deployment", "atrium-beat")["spec"]
    assert beat["replicas"] == 1 and beat["strategy"]["type"] == "Recreate"
    assert named("prod", "Deployment", "atrium-worker")["spec"]["template"]["spec"][
        "containers"][0]["command"][:3] == ["atrium", "worker", "--no-beat"]
    annotations = named("prod", "Ingress", "atrium")["metadata"]["annotations"]
    assert int(annotations["nginx.ingress.kubernetes.io/proxy-read-timeout"]) >= \
        float(config("prod")["ATRIUM_REQUEST_TIMEOUT_S"])
    assert annotations["nginx.ingress.kubernetes.io/proxy-buffering"] == "off"  # SSE


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_workers_serve_exactly_the_lanes(overlay):
    """One Deployment per lane of platform/atrium/lanes.py, named for it, serving its
    queues and nothing else, with its pool, labelled with it (selector included, so no
    two Deployments claim each other's pods), beat left to atrium-beat, and a
    PodDisruptionBudget of its own."""
    served: dict[str, str] = {}
    queues: list[str] = []
    budgets = of_kind(overlay, "PodDisruptionBudget")
    for deployment in of_kind(overlay, "Deployment"):
        name, template = deployment["metadata"]["name"], deployment["spec"]["template"]
        commands = [c.get("command", []) for c in template["spec"]["containers"]]
        workers = [c for c in commands if c[:2] == ["atrium", "worker"]]
        if not workers:
            assert template["metadata"]["labels"].get("app.kubernetes.io/component") \
                != "worker", name
            continue
        [command] = workers
        assert command[2] == "--no-beat" and command.count("--lane") == 1, (name, command)
        lane = command[command.index("--lane") + 1]
        assert lane in LANES, (name, lane)
        assert lane not in served, f"lane {lane}: {served[lane]} and {name}"
        served[lane] = name
        assert name == ("atrium-worker" if lane == "core" else f"atrium-worker-{lane}")
        flags = dict(zip(command[3::2], command[4::2], strict=True))
        these = flags["--queues"].split(",") if "--queues" in flags else LANES[lane].queues
        assert sorted(these) == sorted(LANES[lane].queues), (name, these)
        queues += these
        assert flags.get("--pool", LANES[lane].pool) == LANES[lane].pool, name
        labels = {"app.kubernetes.io/component": "worker", "atrium.dev/lane": lane}
        assert selects(labels, template["metadata"]["labels"]), name
        assert selects(labels, deployment["spec"]["selector"]["matchLabels"]), name
        [budget] = [b for b in budgets if selects(b["spec"]["selector"]["matchLabels"],
                                                  template["metadata"]["labels"])]
        assert budget["metadata"]["name"] == name
    assert sorted(served) == sorted(LANES)
    assert sorted(queues) == sorted(ALL_QUEUES)  # each queue served, by one lane alone


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_lane_gets_the_overlays_worker_patches(overlay):
    # The overlay patches name Deployments by pattern: the lanes' workers must match it.
    workers = [t["spec"] for n, t in pod_templates(overlay) if n.startswith("atrium-worker")]
    assert len(workers) == len(LANES)
    for spec in workers:
        volumes = {v["name"]: v for v in spec["volumes"]}
        if overlay == "prod":
            assert len(spec["topologySpreadConstraints"]) == 2
            assert all("atrium.dev/lane" in c["matchLabelKeys"]
                       for c in spec["topologySpreadConstraints"])
        else:  # the demo model, built in the pod: no models volume in development
            assert volumes["models"] == {"name": "models", "emptyDir": {}}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_pods_refer_only_to_objects_the_overlay_builds(overlay):
    """kustomize renames what is in its own build alone: a lane's worker built with a name
    suffix still names the ConfigMap, the Secret, the PVCs and the ServiceAccount as
    the overlay builds them (the prod Secret is created beforehand, by the operator)."""
    built = {(o["kind"], o["metadata"]["name"]) for o in build(overlay)}
    if overlay == "prod":
        built.add(("Secret", "atrium-secrets"))
    for name, template in pod_templates(overlay):
        spec = template["spec"]
        wanted = {("ServiceAccount", spec["serviceAccountName"])} \
            if "serviceAccountName" in spec else set()
        wanted |= {("PersistentVolumeClaim", v["persistentVolumeClaim"]["claimName"])
                   for v in spec.get("volumes", []) if "persistentVolumeClaim" in v}
        for container in spec["containers"]:
            wanted |= {("ConfigMap", e["configMapRef"]["name"])
                       for e in container.get("envFrom", []) if "configMapRef" in e}
            wanted |= {("Secret", e["secretRef"]["name"])
                       for e in container.get("envFrom", []) if "secretRef" in e}
            wanted |= {("Secret", e["valueFrom"]["secretKeyRef"]["name"])
                       for e in container.get("env", [])
                       if "secretKeyRef" in e.get("valueFrom", {})}
        assert wanted <= built, (name, sorted(wanted - built))


def test_an_overlay_naming_atrium_worker_changes_the_core_lane_alone(tmp_path):
    # kustomize matches replicas entries and patch targets against earlier names too: no
    # lane's worker may ever have been called atrium-worker (base/workers/kustomization).
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "resources": [os.path.relpath(KUSTOMIZE / "base", tmp_path)],
        "replicas": [{"name": "atrium-worker", "count": 7}],
        "patches": [{"target": {"kind": "Deployment", "name": "atrium-worker"},
                     "patch": '[{"op": "add", "path": "/metadata/annotations", '
                              '"value": {"touched": "yes"}}]'}]}))
    out = subprocess.run([shutil.which("kubectl") or "kubectl", "kustomize", str(tmp_path)],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    touched = {d["metadata"]["name"]: (d["spec"]["replicas"], d["metadata"].get(
        "annotations", {}).get("touched")) for d in yaml.safe_load_all(out)
        if d and d["kind"] == "Deployment" and d["metadata"]["name"].startswith("atrium-worker")}
    assert touched.pop("atrium-worker") == (7, "yes")
    assert len(touched) == len(LANES) - 1
    assert all(count != 7 and not mark for count, mark in touched.values()), touched


def _ingress_from(policy: dict[str, Any]) -> list[dict[str, Any]]:
    return [peer for rule in policy["spec"].get("ingress", []) for peer in rule.get("from", [])]


def test_network_policies_fence_engines_and_the_data_stores():
    policies = {p["metadata"]["name"]: p for p in of_kind("prod", "NetworkPolicy")}
    deny = policies["atrium-default-deny"]["spec"]
    assert deny["podSelector"] == {} and deny["policyTypes"] == ["Ingress"] \
        and "ingress" not in deny
    pods = [p["podSelector"]["matchLabels"] for p in _ingress_from(policies["atrium-engine"])
            if "podSelector" in p]
    assert sorted(p["app.kubernetes.io/component"] for p in pods) == ["web", "worker"]
    for store in ("atrium-postgresql", "atrium-redis"):
        peers = _ingress_from(policies[store])
        assert {"app.kubernetes.io/name": "atrium"} in [p.get("podSelector", {}).get(
            "matchLabels") for p in peers]
        assert all("ipBlock" not in p for p in peers)
    dev_stores = {o["metadata"]["name"]: o for o in of_kind("dev", "Deployment")}
    for store, policy in (("postgresql", "atrium-postgresql"), ("redis", "atrium-redis")):
        labels = dev_stores[store]["spec"]["template"]["metadata"]["labels"]
        assert selects(policies[policy]["spec"]["podSelector"]["matchLabels"], labels)


def test_keda_scales_the_engine_pool_on_the_backlog_no_engine_has_a_seat_for():
    # The web tier places a request on one engine's own stream while one has a free seat,
    # else on the model's shared stream (inference/routing.py): that stream's lag is the
    # work the pool cannot hold.
    scaled = named("prod", "ScaledObject", "atrium-engine")
    assert scaled["apiVersion"] == "keda.sh/v1alpha1"
    assert named("prod", "Deployment", scaled["spec"]["scaleTargetRef"]["name"])
    # And the priority lane's lag: priority requests no engine has read (docs/tiers.md).
    shared, priority = scaled["spec"]["triggers"]
    model = config("prod")["ATRIUM_MODEL_NAME"]
    assert shared["metadata"]["stream"] == protocol.request_stream(model)
    assert priority["metadata"]["stream"] == \
        protocol.lane_stream(model, protocol.LANE_PRIORITY)
    for trigger in (shared, priority):
        assert trigger["type"] == "redis-streams"
        assert trigger["metadata"]["consumerGroup"] == protocol.ENGINE_GROUP
        assert int(trigger["metadata"]["lagCount"]) > 0
        auth = named("prod", "TriggerAuthentication", trigger["authenticationRef"]["name"])
        assert {r["parameter"] for r in auth["spec"]["secretTargetRef"]} <= {
            "address", "host", "port", "username", "password"}
    engine = named("prod", "Deployment", "atrium-engine")
    assert engine["metadata"]["labels"]["atrium.dev/model"] == model
    assert not of_kind("dev", "ScaledObject")  # development clusters may lack KEDA
