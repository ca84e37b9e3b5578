"""SamplingParams: every bad field is refused with an InvalidRequestError naming it."""

from __future__ import annotations

from typing import Any

import pytest

from cluster.types import InvalidRequestError, SamplingParams


def test_the_defaults_are_valid_and_greedy() -> None:
    params = SamplingParams()
    assert params.greedy
    assert params.max_tokens >= 1


def test_a_positive_temperature_is_not_greedy() -> None:
    assert not SamplingParams(temperature=0.7).greedy


@pytest.mark.parametrize(
    "field, value",
    [
        ("max_tokens", 0),
        ("max_tokens", -5),
        ("max_tokens", 2.0),
        ("temperature", -0.1),
        ("temperature", float("nan")),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -1),
        ("top_k", 1.5),
        ("min_p", -0.1),
        ("min_p", 1.5),
        ("stop", ("ok", "")),
    ],
)
def test_a_bad_value_is_refused_naming_its_field(field: str, value: Any) -> None:
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**{field: value})
    assert str(info.value).startswith(f"{field}:")


@pytest.mark.parametrize(
    "field, value",
    [("temperature", "0.7"), ("top_p", "0.9"), ("min_p", None)],
)
def test_a_value_of_the_wrong_type_is_refused_naming_its_field(field: str, value: Any) -> None:
    # A JSON request can carry any type; it must get the same typed error, not a TypeError.
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**{field: value})
    assert str(info.value).startswith(f"{field}:")


def test_the_edges_of_each_range_are_accepted() -> None:
    params = SamplingParams(max_tokens=1, temperature=0.0, top_p=1.0, top_k=0, min_p=1.0)
    assert (params.max_tokens, params.top_p, params.min_p) == (1, 1.0, 1.0)
    assert SamplingParams(top_p=1e-9, min_p=0.0).top_p == 1e-9
