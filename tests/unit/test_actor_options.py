"""What a worker asks Ray for: one GPU by default where its engine runs on CUDA, and no
view of the GPUs when it is given none on a cluster that has them."""

from __future__ import annotations

import pytest

from cluster.actor_options import actor_options

HIDDEN = {"env_vars": {"CUDA_VISIBLE_DEVICES": ""}}


@pytest.mark.parametrize(
    "num_gpus, device, cluster_gpus, asks, runtime_env",
    [
        (None, "auto", 8, 1.0, None),  # a GPU cluster: one GPU per worker, Ray sets the id
        (None, "cuda", 8, 1.0, None),
        (None, "auto", 0, 0.0, None),  # a CPU-only cluster: as before, nothing to hide
        (None, "cpu", 8, 0.0, HIDDEN),  # a CPU engine on a GPU node keeps off the GPUs
        (0, "auto", 8, 0, HIDDEN),  # asked for none: auto means the CPU, not cuda:0
        (0.5, "cuda", 8, 0.5, None),  # two workers share one GPU, as asked
        (2, "auto", 8, 2, None),
    ],
)
def test_gpus_follow_the_engines_device_and_a_worker_without_one_sees_none(
    num_gpus: float | None,
    device: str,
    cluster_gpus: float,
    asks: float,
    runtime_env: dict[str, dict[str, str]] | None,
) -> None:
    options = actor_options("decode-0", 1.0, num_gpus, device, {"decode_node": 1}, cluster_gpus)
    assert options["num_gpus"] == asks
    assert options.get("runtime_env") == runtime_env
    assert (options["name"], options["num_cpus"], options["resources"]) == (
        "decode-0",
        1.0,
        {"decode_node": 1},
    )
