"""The lab's capacity arithmetic (GET /lab/capacity): plan capacity's own numbers for the
page's inputs, and a clear refusal naming the field for a bad one."""

from __future__ import annotations

import pytest

from cluster.config import ConfigError
from splitserve.capacity import ARCHITECTURES, kv_capacity
from splitserve.lab import capacity

QUERY = {"model": "llama-3-70b", "hardware": "A100", "weight_bits": "16", "kv_cache_gb": "10",
         "context": "8192"}  # fmt: skip


def test_the_textbook_70b_on_an_a100_does_not_fit_and_its_kv_matches_the_plan() -> None:
    plan = capacity(QUERY)
    cap = kv_capacity(ARCHITECTURES["llama-3-70b"], "bfloat16", 16, 10)
    assert (plan["pages"], plan["tokens"]) == (cap.pages, cap.tokens) == (2048, 32768)
    assert plan["sequences"] == cap.sequences(8192) == 4  # 512 pages each
    assert plan["kv_kib_per_token"] == 320.0
    assert round(plan["weights_gb"]) == 141 and not plan["fits"]  # 141 GB of weights > 80
    assert capacity({**QUERY, "weight_bits": "4", "kv_cache_gb": "20"})["fits"]
    assert plan["bound_at_batch"] == "memory" and plan["batch"] == 4


def test_the_70b_fits_four_a100s_as_plan_capacity_splits_it() -> None:
    four = capacity({**QUERY, "tensor_parallel": "4"})
    assert four["fits"] and round(four["weights_gb"], 1) == 35.3  # per device
    assert four["pages"] == 4 * capacity(QUERY)["pages"]  # 2 of 8 KV heads a device
    assert four["allreduce_ms_at_batch"] > 0 == capacity(QUERY)["allreduce_ms_at_batch"]


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("model", "gpt-5", "model: one of ["),
        ("hardware", "TPU", "hardware: one of ["),
        ("kv_cache_gb", "-1", "kv_cache_gb: a finite number, at least 0, got -1"),
        ("kv_cache_gb", "nan", "kv_cache_gb: a finite number, at least 0, got nan"),
        ("context", "1e400", "context: a number is needed, got '1e400'"),
        ("context", "lots", "context: a number is needed, got 'lots'"),
        ("kv_dtype", "int2", "kv_dtype: one of ["),
        ("tensor_parallel", "0", "tensor_parallel: a finite number, at least 1, got 0"),
    ],
)
def test_a_bad_input_is_refused_naming_its_field(field: str, value: str, message: str) -> None:
    with pytest.raises(ConfigError) as refused:
        capacity({**QUERY, field: value})
    assert str(refused.value).startswith(message)
