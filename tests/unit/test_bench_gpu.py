"""`splitserve bench gpu`'s yardsticks: the roofline of the GPU at hand, not of one model
of GPU, and the bytes a decode step really reads."""

from __future__ import annotations

from splitserve.bench.gpu import DRY, FULL, PAGE, Decode, decode_bytes, profile_of
from splitserve.capacity import ARCHITECTURES, weight_bytes

GB = 10**9


def test_each_gpu_is_measured_against_its_own_published_figures() -> None:
    named = {
        "NVIDIA H100 80GB HBM3": ("H100", 80 * GB, 3350, 989),  # SXM
        "NVIDIA H100 PCIe": ("H100 PCIe", 80 * GB, 2000, 756),
        "NVIDIA H100 NVL": ("H100 NVL", 94 * GB, 3900, 835),
        "NVIDIA H200": ("H200", 141 * GB, 4800, 989),
        "NVIDIA A100-SXM4-40GB": ("A100-40GB", 40 * GB, 1555, 312),
        "NVIDIA A100-SXM4-80GB": ("A100", 80 * GB, 2039, 312),
        "NVIDIA L40S": ("L40S", 48 * GB, 864, 362),
    }
    for device, (name, memory, bandwidth, tflops) in named.items():
        hw = profile_of(device, memory)
        assert hw is not None, device
        assert (hw.name, hw.bandwidth_gb_s, hw.tflops) == (name, bandwidth, tflops)
    assert profile_of("NVIDIA GeForce RTX 4090", 24 * GB) is None  # no figures: no share


def test_the_roofline_share_divides_by_the_devices_bandwidth() -> None:
    step = Decode("m", 1, 2048, step_s=0.005, bytes_per_step=10 * GB, bandwidth_gb_s=3350)
    assert round(step.roofline_share or 0, 4) == round(10 / 3350 / 0.005, 4)  # 59.7%
    assert Decode("m", 1, 2048, 0.005, 10 * GB, None).roofline_share is None


def test_a_decode_step_reads_an_untied_embedding_table_one_row_at_a_time() -> None:
    llama = ARCHITECTURES["llama-3-8b"]
    weights, kv = int(weight_bytes(llama, 16)), 10**8
    table = llama.vocab_size * llama.hidden_size * 2  # 128256 x 4096 in bf16: 1.05 GB
    assert not llama.tie_embeddings
    assert decode_bytes(llama, weights, kv, 2) == weights - table + kv  # ~7% fewer
    smol = ARCHITECTURES["smollm2-135m"]  # tied: the table is read whole, as the head
    assert smol.tie_embeddings
    assert decode_bytes(smol, 10**8, kv, 2) == 10**8 + kv


def test_the_dry_run_prefills_past_its_decode_context_as_the_full_run_does() -> None:
    """The rig's page table must hold its longest prefill, not only a decode context: a
    dry run that never prefills past its context missed that (8k prompts on 2k contexts)."""
    for sizes in (FULL, DRY):
        assert sizes.prefill > sizes.context + PAGE
