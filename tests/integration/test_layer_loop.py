"""The runner's C layer loop (cluster/engine/layer_loop.py) on the bundled model and tiny
Qwen2, Qwen3 and Gemma 1-3 checkpoints: every
step it takes gives the eager forward's logits bit for bit, and where it cannot be built
the eager forward runs, with one warning naming why."""

from __future__ import annotations

import logging
import os
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from cluster.config import EngineConfig
from cluster.engine import layer_loop
from cluster.engine.engine import LLMEngine
from cluster.engine.kernels import native, qmatmul
from cluster.engine.sched.scheduler import Step
from cluster.engine.sched.sequence import Sequence
from cluster.types import SamplingParams
from tests.helpers import assert_no_leak
from tests.integration.conftest import RAW_PROMPTS

pytestmark = pytest.mark.skipif(
    not qmatmul.available(), reason="qmatmul.c needs AVX-512 VNNI or AVX2 and a C compiler"
)


@pytest.fixture(
    scope="module",
    params=[
        "bundled-float32",
        "bundled-bfloat16",
        "bundled-fp8kv-bfloat16",
        "qwen2-int8-float32",
        "qwen3-int8-float32",
        "qwen3-int8-bfloat16",
        "gemma-int8-bfloat16",
        "gemma2-int8-float32",
        "gemma3-int8-bfloat16",
    ],
)
def engine(request: pytest.FixtureRequest) -> Iterator[LLMEngine]:
    """32-token steps, so long prompts come in chunks after their context. The bundled
    model over its GGUF blocks (with fp8 KV pages too: the loop codes and scales them as
    the eager store does); a tiny Qwen2 quantized to 8 bits at load, whose qkv bias (zero
    as transformers initialises it) is made random here, so the loop adds it too; a tiny
    Qwen3 the same way, its q and k heads RMSNorm'd in the loop as in the eager step; tiny
    Gemmas: GELU, and Gemma 2's and 3's norms around each sublayer, 8-token windows,
    soft-capping (2) and local RoPE tables (3)."""
    model, dtype = request.param.rsplit("-", 1)
    where: dict[str, str] = {}
    if model.startswith(("qwen", "gemma")):
        tiny = request.getfixturevalue(f"tiny_{model.split('-')[0]}_dir")
        where = {"model": str(tiny), "quantization": "int8"}
    if model.endswith("fp8kv"):
        where = {"kv_cache_dtype": "fp8"}
    e = LLMEngine(
        EngineConfig(
            **{"quantization": "gguf", **where},
            dtype=dtype,
            device="cpu",
            kv_cache_gb=0.1,
            max_num_batched_tokens=32,
        )
    )
    if e.spec.qkv_bias:
        g = torch.Generator().manual_seed(5)
        for layer in e.model.layers:
            assert layer.qkv.bias is not None
            layer.qkv.bias.copy_(torch.randn(layer.qkv.bias.shape, generator=g))
    yield e
    assert_no_leak(e)


def test_every_step_of_the_loop_is_the_eager_step_bit_for_bit(engine: LLMEngine) -> None:
    runner = engine.runner
    loop = runner.loop
    assert loop is not None, "gguf on our kernel: the loop takes the steps"
    run = runner.run
    kinds: Counter[str] = Counter()

    def both(step: Step, on_layer: object = None) -> tuple[list[Sequence], torch.Tensor]:
        """The step run eager, then by the loop (one call), then by the loop a layer at a
        time: each writes the same K and V to the same slots, so each sees the same cache."""
        assert on_layer is None  # no KV sink here
        runner.loop = None
        sampled, eager = run(step)
        runner.loop = loop
        assert run(step)[1].equal(eager)
        layers: list[int] = []
        assert run(step, layers.append)[1].equal(eager)
        assert layers == list(range(engine.spec.num_layers))
        context = any(s.num_computed > 0 for s, _ in step.prefills)
        kinds["decodes" if step.decodes else "no decodes"] += 1
        kinds["prefill after context" if context else "prefill" if step.prefills else "none"] += 1
        return sampled, eager

    runner.run = both  # type: ignore[method-assign]
    try:
        greedy = SamplingParams(max_tokens=6, ignore_eos=True, logprobs=True, top_logprobs=2)
        prompt_logprobs = SamplingParams(max_tokens=3, ignore_eos=True, prompt_logprobs=1)
        engine.generate(RAW_PROMPTS, greedy)
        engine.generate(RAW_PROMPTS[-1:] * 2, [greedy, prompt_logprobs])  # a prefix hit
    finally:
        del runner.run
    assert runner.loop is loop
    assert kinds["decodes"] and kinds["no decodes"], kinds
    assert kinds["prefill after context"] and kinds["prefill"], kinds


def test_greedy_tokens_with_the_loop_are_the_eager_tokens(engine: LLMEngine) -> None:
    greedy = SamplingParams(max_tokens=16, ignore_eos=True)
    looped = [c.token_ids for c in engine.generate(RAW_PROMPTS, greedy)]
    loop, engine.runner.loop = engine.runner.loop, None
    try:
        eager = [c.token_ids for c in engine.generate(RAW_PROMPTS, greedy)]
    finally:
        engine.runner.loop = loop
    assert looped == eager


def test_a_loop_that_cannot_be_built_leaves_the_eager_forward_with_one_warning(
    engine: LLMEngine,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A compiler that fails on layer_loop.c alone (the other kernels keep their builds)."""
    cc = tmp_path / "cc"
    real = os.environ.get("CC") or "cc"
    cc.write_text(
        f'#!/bin/sh\ncase "$*" in *layer_loop.c*) echo "no loop today" >&2; exit 1;; esac\n'
        f'exec {real} "$@"\n'
    )
    cc.chmod(0o755)
    monkeypatch.setenv("CC", str(cc))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    layer_loop._library.cache_clear()
    native.library.cache_clear()
    try:
        with caplog.at_level(logging.WARNING):
            runner = engine.runner
            assert layer_loop.build(engine.model, engine.cache, runner.attention) is None
            assert layer_loop.build(engine.model, engine.cache, runner.attention) is None
    finally:
        layer_loop._library.cache_clear()
        native.library.cache_clear()
    warnings = [r.getMessage() for r in caplog.records if r.name == "cluster.engine.kernels.native"]
    assert len(warnings) == 1 and "layer_loop.c" in warnings[0], warnings
    assert "no loop today" in warnings[0]
