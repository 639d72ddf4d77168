"""The Helm chart as Helm's own engine (the Go library, through helm-python-sdk) lints and renders it, with the
default values and with the TP=2 x PP=2 values file: every rendered object valid against the Kubernetes schemas
(kubernetes-validate) or its CRD's schema (RayService, ServiceMonitor, PodMonitor, PrometheusRule), and the
``serveConfigV2`` it renders, taken out of the RayService, started with Ray Serve on CPU: it answers a completion."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import jsonschema
import kubernetes_validate
import pytest
import ray
import yaml

from server.args import ServeArgs
from ray._common.utils import import_attr
from ray.serve._private.api import call_user_app_builder_with_args_if_necessary
from ray.serve.schema import ServeDeploySchema

helm = pytest.importorskip("helm_python")

from cluster.config import EngineConfig, model_config, plan  # noqa: E402
from server.engine import scheduler_actors  # noqa: E402
from server.serve_env import THROUGHPUT_ENV  # noqa: E402
from tests.server.conftest import serving  # noqa: E402

ROOT = Path(__file__).parents[2]
CHART = ROOT / "helm" / "vattn"
CRDS = Path(__file__).parent / "crds"
KUBERNETES = "1.30"
TP2PP2 = yaml.safe_load((CHART / "values-tp2pp2.yaml").read_text())
VALUE_SETS = {"default": {}, "tp2pp2": TP2PP2}


def strict(schema):
    """``schema`` refusing unknown fields, as kubeconform's strict mode does: the API server would prune a
    misspelt field silently (a ``workerGroupSpec`` that never makes a worker)."""
    if isinstance(schema, dict):
        schema = {k: strict(v) for k, v in schema.items()}
        if "properties" in schema and "additionalProperties" not in schema \
                and not schema.get("x-kubernetes-preserve-unknown-fields"):
            schema["additionalProperties"] = False
    elif isinstance(schema, list):
        schema = [strict(v) for v in schema]
    return schema


def crd_schemas() -> dict[tuple[str, str], dict]:
    """(apiVersion, kind) -> the CRD's openAPIV3Schema, strict."""
    out = {}
    for path in CRDS.glob("*.yaml"):
        crd = yaml.safe_load(path.read_text())
        for version in crd["spec"]["versions"]:
            out[f"{crd['spec']['group']}/{version['name']}", crd["spec"]["names"]["kind"]] = strict(version["schema"]["openAPIV3Schema"])
    return out


def render(values: dict, namespace: str = "llm") -> list[dict]:
    manifests = helm.Chart.load(CHART).render(values, name="vattn", namespace=namespace)
    return [doc for path, text in manifests.items() if not path.endswith("NOTES.txt")
            for doc in yaml.safe_load_all(text) if doc]


def one(objects: list[dict], kind: str) -> dict:
    (obj,) = [o for o in objects if o["kind"] == kind]
    return obj


@pytest.mark.parametrize("values", VALUE_SETS.values(), ids=VALUE_SETS.keys())
def test_lint_is_clean(values):
    report = helm.lint(CHART, values, strict=True, kube_version=f"v{KUBERNETES}.0")
    assert report["errors"] == [] and report["messages"] == [], report


def assert_valid(objects: list[dict]) -> None:
    schemas = crd_schemas()
    for obj in objects:
        schema = schemas.get((obj["apiVersion"], obj["kind"]))
        if schema is not None:
            # Not jsonschema.validate: it checks the schema first, and the CRDs' patterns are Go's regexps
            # (``^(?i)...``), which only matter where an object has that field.
            errors = [f"{'.'.join(map(str, e.path))}: {e.message}" for e in jsonschema.Draft7Validator(schema).iter_errors(obj)]
            assert not errors, f"{obj['kind']} {obj['metadata']['name']}: {errors}"
        else:
            kubernetes_validate.validate(obj, KUBERNETES, strict=True)


@pytest.mark.parametrize("values", VALUE_SETS.values(), ids=VALUE_SETS.keys())
def test_every_rendered_object_is_valid(values):
    objects = render(values)
    kinds = sorted(o["kind"] for o in objects)
    assert kinds == ["ConfigMap", "ConfigMap", "Pod", "PodDisruptionBudget", "PodMonitor", "PrometheusRule", "RayService",
                     "Service", "ServiceMonitor"]
    assert_valid(objects)
    assert {o["metadata"]["namespace"] for o in objects} == {"llm"}


def test_without_the_monitoring_stack_or_a_model_volume_the_objects_stay_valid():
    off = {"enabled": False}
    objects = render({"model": {"volume": {"type": "none"}}, "ncclEnv": {}, "serve": {"numReplicas": 3},
                      "monitoring": {"serviceMonitor": off, "podMonitor": off, "prometheusRule": off},
                      "grafana": {"dashboards": off}})
    assert sorted(o["kind"] for o in objects) == ["Pod", "PodDisruptionBudget", "RayService", "Service"]
    assert_valid(objects)
    (group,) = one(objects, "RayService")["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    assert group["replicas"] == group["minReplicas"] == group["maxReplicas"] == 3


def test_a_replica_pod_asks_for_tp_times_pp_gpus_and_the_serve_config_says_so():
    for values, gpus in ((VALUE_SETS["default"], "1"), (TP2PP2, "4")):
        service = one(render(values), "RayService")
        (group,) = service["spec"]["rayClusterConfig"]["workerGroupSpecs"]
        (container,) = group["template"]["spec"]["containers"]
        assert container["resources"]["limits"]["nvidia.com/gpu"] == gpus
        assert container["resources"]["requests"]["nvidia.com/gpu"] == gpus
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env["NCCL_NVLS_ENABLE"] == "0" and env["TORCH_SYMM_MEM_DISABLE_MULTICAST"] == "1"
        (app,) = yaml.safe_load(service["spec"]["serveConfigV2"])["applications"]
        args = app["args"]
        assert args["tensor_parallel_size"] * args["pipeline_parallel_size"] == int(gpus)
    assert args["model"] == "/models/yi-34b-chat" and args["kv_memory"] == "30GiB" and "kv_memory_fraction" not in args


def test_every_ray_pod_runs_serve_on_the_data_plane_vattn_serve_uses():
    rayservice = one(render({}), "RayService")["spec"]["rayClusterConfig"]
    for pod in [rayservice["headGroupSpec"]] + rayservice["workerGroupSpecs"]:
        env = {e["name"]: e.get("value") for e in pod["template"]["spec"]["containers"][0]["env"]}
        assert {k: env.get(k) for k in THROUGHPUT_ENV} == THROUGHPUT_ENV


def test_by_default_the_kv_pool_is_a_fraction_of_what_the_weights_leave():
    (app,) = yaml.safe_load(one(render({}), "RayService")["spec"]["serveConfigV2"])["applications"]
    assert app["args"]["kv_memory_fraction"] == 0.9 and "kv_memory" not in app["args"]


def test_gpu_memory_utilization_sizes_the_pool_instead_of_the_fraction():
    service = one(render({"engine": {"gpuMemoryUtilization": 0.8}}), "RayService")
    (app,) = yaml.safe_load(service["spec"]["serveConfigV2"])["applications"]
    assert app["args"]["gpu_memory_utilization"] == 0.8 and "kv_memory_fraction" not in app["args"]
    assert "kv_memory" not in app["args"] and ServeArgs.parse(app["args"]).engine().gpu_memory_utilization == 0.8


def test_prefix_caching_is_on_by_default_and_a_value_turns_it_off():
    for values, on in (({}, True), ({"engine": {"enablePrefixCaching": False}}, False)):
        (app,) = yaml.safe_load(one(render(values), "RayService")["spec"]["serveConfigV2"])["applications"]
        assert app["args"]["enable_prefix_caching"] is on
        assert ServeArgs.parse(app["args"]).engine().enable_prefix_caching is on


def test_deterministic_is_off_by_default_and_a_value_turns_it_on():
    for values, on in (({}, False), ({"engine": {"deterministic": True}}, True)):
        (app,) = yaml.safe_load(one(render(values), "RayService")["spec"]["serveConfigV2"])["applications"]
        assert app["args"]["deterministic"] is on
        assert ServeArgs.parse(app["args"]).engine().deterministic is on


def test_free_slots_are_prepared_by_default_and_a_value_turns_it_off():
    for values, slots in (({}, 64), ({"engine": {"eagerSlots": 0}}, 0)):
        (app,) = yaml.safe_load(one(render(values), "RayService")["spec"]["serveConfigV2"])["applications"]
        assert app["args"]["eager_slots"] == slots
        assert ServeArgs.parse(app["args"]).engine().eager_slots == slots


def test_mixed_step_graphs_are_the_engines_default_unless_a_value_is_given():
    for values, tokens in (({}, None), ({"engine": {"mixedGraphTokens": 0}}, 0),
                           ({"engine": {"mixedGraphTokens": 1024}}, 1024)):
        (app,) = yaml.safe_load(one(render(values), "RayService")["spec"]["serveConfigV2"])["applications"]
        assert ("mixed_graph_tokens" in app["args"]) == (tokens is not None)  # 0 is a value: it turns them off
        assert ServeArgs.parse(app["args"]).engine().mixed_graph_tokens == tokens


def test_the_api_key_comes_from_the_secret_into_every_ray_pod_and_the_test_pod():
    objects = render({"apiKey": {"secretName": "vattn-key", "secretKey": "token"}})
    service = one(objects, "RayService")["spec"]["rayClusterConfig"]
    pods = [service["headGroupSpec"]["template"], service["workerGroupSpecs"][0]["template"], {"spec": one(objects, "Pod")["spec"]}]
    for pod in pods:
        (key,) = [e for e in pod["spec"]["containers"][0]["env"] if e["name"] == "VATTN_API_KEY"]
        assert key["valueFrom"]["secretKeyRef"] == {"name": "vattn-key", "key": "token"}
    assert "api_key" not in one(objects, "RayService")["spec"]["serveConfigV2"]  # never in the CR itself


def test_the_rules_and_dashboards_are_the_repositorys_own():
    objects = render({})
    rules = yaml.safe_load((ROOT / "dashboards" / "rules.yaml").read_text())
    assert one(objects, "PrometheusRule")["spec"] == rules
    maps = {name: json.loads(text) for o in objects if o["kind"] == "ConfigMap" for name, text in o["data"].items()}
    assert maps == {p.name: json.loads(p.read_text()) for p in (ROOT / "dashboards").glob("*.json")}
    assert all(o["metadata"]["labels"]["grafana_dashboard"] == "1" for o in objects if o["kind"] == "ConfigMap")


@pytest.mark.parametrize(("values", "message"), [
    ({"engine": {"tensorParallelSize": 0}}, "tensorParallelSize"),
    ({"engine": {"kvLayout": "blocks"}}, "kvLayout"),
    ({"engine": {"kvMemory": "lots"}}, "kvMemory"),
    ({"engine": {"kvMemoryFraction": 1.5}}, "kvMemoryFraction"),
    ({"engine": {"gpuMemoryUtilization": 0}}, "gpuMemoryUtilization"),
    ({"engine": {"mixedGraphTokens": -1}}, "mixedGraphTokens"),
    ({"model": {"volume": {"type": "nfs"}}}, "type"),
    ({"serve": {"replicas": 2}}, "replicas"),
    ({"image": {"digest": "latest"}}, "digest"),
    ({"networkPolicy": {"apiFrom": "everyone"}}, "apiFrom"),
    ({"probes": {"periodSeconds": 0}}, "periodSeconds"),
    ({"gcsFaultTolerance": {"enabled": True}}, "redisAddress"),
    ({"gcsFaultTolerance": {"redisAddress": "redis://r:6379"}}, "redisAddress"),
])
def test_bad_values_are_refused_by_the_schema_naming_them(values, message):
    with pytest.raises(helm.HelmError, match=message):
        helm.Chart.load(CHART).render(values, name="vattn", namespace="llm")


def test_the_rendered_serve_config_serves_on_cpu():
    """What the cluster would run, run for real: the chart rendered for the ``tiny`` preset on CPU (no model
    volume; the default KV memory fraction, which stops at every slot full), its serveConfigV2 validated by Ray
    Serve's own schema and started."""
    values = {"model": {"path": "tiny", "servedName": "tiny", "volume": {"type": "none"}},
              "engine": {"device": "cpu", "pageSize": "4KiB", "maxModelLen": 256, "maxNumSeqs": 16}}
    config = ServeDeploySchema.model_validate(yaml.safe_load(one(render(values), "RayService")["spec"]["serveConfigV2"]))
    assert config.proxy_location == "HeadOnly"
    (app,) = config.applications
    build = import_attr(app.import_path)
    # The config's http_options (0.0.0.0:8000) are the pod's; here the app runs on a free loopback port.
    with serving(lambda: call_user_app_builder_with_args_if_necessary(build, app.args), name=app.name,
                 route_prefix=app.route_prefix) as url:
        r = httpx.post(f"{url}/v1/completions", timeout=60,
                       json={"model": "tiny", "prompt": "hello", "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length", r.text
        assert httpx.get(f"{url}/health").json()["status"] == "ok"
        (scheduler,) = scheduler_actors().values()
        (worker,) = ray.get(scheduler.snapshot.remote()).workers
        spec = plan(EngineConfig("tiny", max_num_seqs=16, max_model_len=256, page_size=4096), model_config("tiny"), "cpu").ledger_spec
        assert worker.total_pages == 16 * spec.pages_for(256)  # 0.9 of the host's memory, stopped at 16 full slots


def pods_of(objects: list[dict]) -> list[dict]:
    """Every pod the release makes: the test Pod, and the RayService's head and worker-group templates as the Pods
    KubeRay creates from them (metadata and spec as written; the scanners know Pods, not RayService)."""
    pods = [o for o in objects if o["kind"] == "Pod"]
    for service in (o for o in objects if o["kind"] == "RayService"):
        cluster = service["spec"]["rayClusterConfig"]
        groups = [("head", cluster["headGroupSpec"])] + [(g["groupName"], g) for g in cluster["workerGroupSpecs"]]
        for name, group in groups:
            meta = {**group["template"]["metadata"], "name": f"{service['metadata']['name']}-{name}",
                    "namespace": service["metadata"]["namespace"]}
            pods.append({"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": group["template"]["spec"]})
    return pods


def test_a_network_policy_and_a_pinned_image_render_valid_when_asked():
    gateway = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "gateway"}}}
    objects = render({"networkPolicy": {"enabled": True, "apiFrom": [gateway]}, "image": {"digest": "sha256:" + "a" * 64}})
    assert_valid(objects)
    policy = one(objects, "NetworkPolicy")
    assert policy["spec"]["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": "vattn", "app.kubernetes.io/instance": "vattn"}
    api = [rule for rule in policy["spec"]["ingress"] if rule.get("from") == [gateway]]
    assert [p["port"] for rule in api for p in rule["ports"]] == [8000]
    assert {c["image"] for pod in pods_of(objects)[1:] for c in pod["spec"]["containers"]} == {"ghcr.io/vattn/vattn@sha256:" + "a" * 64}


def test_gcs_fault_tolerance_points_the_cluster_at_redis_with_the_password_from_its_secret():
    ft = {"enabled": True, "redisAddress": "redis-master.redis.svc:6379", "passwordSecret": {"name": "redis"}}
    objects = render({"gcsFaultTolerance": ft})
    assert_valid(objects)
    options = one(objects, "RayService")["spec"]["rayClusterConfig"]["gcsFaultToleranceOptions"]
    assert options == {"redisAddress": "redis-master.redis.svc:6379",
                       "redisPassword": {"valueFrom": {"secretKeyRef": {"name": "redis", "key": "password"}}}}
    assert "gcsFaultToleranceOptions" not in one(render({}), "RayService")["spec"]["rayClusterConfig"]


def test_the_disruption_budget_selects_the_gpu_worker_pods_only():
    objects = render({})
    selector = one(objects, "PodDisruptionBudget")["spec"]["selector"]["matchLabels"]
    labels = {p["metadata"]["name"]: {**p["metadata"]["labels"], "ray.io/node-type": "head" if p["metadata"]["name"].endswith("head") else "worker"}
              for p in pods_of(objects)[1:]}  # KubeRay adds ray.io/node-type to the pods it makes
    assert [name for name, pod in labels.items() if selector.items() <= pod.items()] == ["vattn-gpu"]


def checkov() -> str:
    """The checkov CLI: $CHECKOV, the one `make test` installs beside the venv, or one on the PATH."""
    beside = Path(sys.executable).parents[1] / "checkov" / "bin" / "checkov"
    found = os.environ.get("CHECKOV") or (str(beside) if beside.exists() else shutil.which("checkov"))
    if not found:
        pytest.skip("checkov is not installed (`make test` installs it in .venv/checkov)")
    return found


@pytest.mark.parametrize("values", [*VALUE_SETS.values(), {"networkPolicy": {"enabled": True}}],
                         ids=[*VALUE_SETS.keys(), "network-policy"])
def test_checkov_finds_no_unexplained_failure_in_the_rendered_chart(values, tmp_path):
    """checkov's Kubernetes checks over every rendered object and every pod the release makes (locked-down security
    contexts, resources, probes, no API token, a namespace): none fails, and each check skipped is skipped by an
    annotation in the chart that gives its reason."""
    objects = render(values)
    path = tmp_path / "chart.yaml"
    path.write_text(yaml.safe_dump_all(objects + pods_of(objects)[1:]))
    run = subprocess.run([checkov(), "-f", str(path), "--framework", "kubernetes", "-o", "json", "--skip-download"],
                         capture_output=True, text=True, timeout=300)
    report = json.loads(run.stdout)
    results = report["results"]
    assert [(c["check_id"], c["resource"]) for c in results["failed_checks"]] == []
    pods = {f"Pod.llm.{p['metadata']['name']}": p for p in pods_of(objects)}
    assert {c["resource"] for c in results["passed_checks"]} >= set(pods)  # the lifted pods were checked
    reasons = {r: {v.split("=", 1)[0]: v.split("=", 1)[1] for k, v in p["metadata"].get("annotations", {}).items()
                   if k.startswith("checkov.io/skip")} for r, p in pods.items()}
    for skipped in results["skipped_checks"]:
        assert len(reasons[skipped["resource"]][skipped["check_id"]]) > 20, skipped
