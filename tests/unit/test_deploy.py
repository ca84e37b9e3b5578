"""The deploy files parse, and every node type a pool needs exists with room for a worker."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from cluster.config import PoolConfig, load_serve_config

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
CONFIG = load_serve_config(DEPLOY / "splitserve.yaml")
POOLS = {"prefill": CONFIG.prefill, "decode": CONFIG.decode}


def _launcher_nodes() -> dict[str, dict[str, float]]:
    doc = yaml.safe_load((DEPLOY / "ray-cluster.yaml").read_text())
    assert doc["head_node_type"] in doc["available_node_types"]
    return {
        name: {**t["resources"], "max_nodes": t.get("max_workers", 0)}
        for name, t in doc["available_node_types"].items()
    }


def _kuberay_nodes() -> dict[str, dict[str, float]]:
    doc = yaml.safe_load((DEPLOY / "kuberay.yaml").read_text())
    assert doc["kind"] == "RayCluster"
    nodes = {}
    for group in doc["spec"]["workerGroupSpecs"]:
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
