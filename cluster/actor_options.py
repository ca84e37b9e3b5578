"""What a worker actor asks Ray for: CPUs, GPUs, custom resources, and the GPUs it sees.

Ray sets CUDA_VISIBLE_DEVICES only for an actor given GPUs; one given none sees every GPU
of its node (Ray >= 2.4x no longer hides them), so `device: auto` would put every such
worker on cuda:0. Hence: `num_gpus` null (the default) asks for one GPU when the engine
runs on CUDA (device cuda, or auto on a cluster with GPUs), and a worker given no GPU on
a cluster with GPUs has them hidden, so auto means the CPU there.
"""

from __future__ import annotations

from typing import Any


def worker_gpus(num_gpus: float | None, device: str, cluster_gpus: float) -> float:
    """GPUs one worker asks for: `num_gpus`, or when None one if its engine runs on CUDA."""
    if num_gpus is not None:
        return num_gpus
    return 1.0 if device == "cuda" or (device == "auto" and cluster_gpus > 0) else 0.0


def rank_bundles(options: dict[str, Any], size: int) -> list[dict[str, float]]:
    """The placement group of a worker whose model is split across `size` ranks (its
    actor's `options`): a bundle per rank of the worker's CPUs and GPUs, the worker's
    custom resources (its node type's) in rank 0's only."""
    each = {"CPU": options["num_cpus"], "GPU": options["num_gpus"]}
    each = {k: v for k, v in each.items() if v}
    return [{**each, **options["resources"]}] + [dict(each) for _ in range(size - 1)]


def actor_options(
    name: str,
    num_cpus: float,
    num_gpus: float | None,
    device: str,  # the engine's configured device: auto, cpu or cuda
    resources: dict[str, float],
    cluster_gpus: float,  # ray.cluster_resources()'s GPU count
) -> dict[str, Any]:
    """Ray's `.options(...)` for one worker actor."""
    gpus = worker_gpus(num_gpus, device, cluster_gpus)
    options: dict[str, Any] = {
        "name": name,
        "num_cpus": num_cpus,
        "num_gpus": gpus,
        "resources": resources,
    }
    if gpus == 0 and cluster_gpus > 0:
        options["runtime_env"] = {"env_vars": {"CUDA_VISIBLE_DEVICES": ""}}
    return options
