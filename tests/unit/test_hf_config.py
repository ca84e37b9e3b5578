"""A Hugging Face config.json read into a ModelSpec: the families served, and what is refused
naming the key or capped where the engine does not compute it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from cluster.engine.model.checkpoint import HF_ARCHITECTURES, spec_from_hf_config
from cluster.engine.model.checkpoint_quant import read_quant_config
from cluster.engine.model.model_files import ModelLoadError

BASE = {
    "vocab_size": 100,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "max_position_embeddings": 512,
}


def _spec(tmp_path: Path, architecture: str, **keys: Any) -> Any:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**BASE, "architectures": [architecture], **keys}))
    return spec_from_hf_config(path)


def test_qwen3_normalizes_its_q_and_k_heads_and_the_others_do_not(tmp_path: Path) -> None:
    assert _spec(tmp_path, "Qwen3ForCausalLM", head_dim=32).qk_norm
    assert _spec(tmp_path, "Qwen3ForCausalLM", head_dim=32).head_dim == 32
    assert not _spec(tmp_path, "LlamaForCausalLM").qk_norm
    assert _spec(tmp_path, "Qwen2ForCausalLM").qkv_bias


def test_a_family_not_served_is_refused_naming_it_and_those_that_are(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="'GPTNeoXForCausalLM' is not supported") as e:
        _spec(tmp_path, "GPTNeoXForCausalLM")
    assert all(name in str(e.value) for name in HF_ARCHITECTURES)


def test_partial_rotary_embeddings_are_refused_naming_the_key(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"partial_rotary_factor 0\.5 is not supported"):
        _spec(tmp_path, "Phi3ForCausalLM", partial_rotary_factor=0.5)


def test_a_sliding_window_caps_the_context_unless_it_is_off(tmp_path: Path) -> None:
    assert _spec(tmp_path, "Phi3ForCausalLM", sliding_window=100).max_position == 100
    assert _spec(tmp_path, "MistralForCausalLM", sliding_window=4096).max_position == 512
    off = {"sliding_window": 100, "use_sliding_window": False}
    assert _spec(tmp_path, "Qwen2ForCausalLM", **off).max_position == 512


def test_gemma_reads_which_layers_slide_and_refuses_what_it_does_not_compute(
    tmp_path: Path,
) -> None:
    four = {"num_hidden_layers": 4, "head_dim": 16, "sliding_window": 32}
    g2 = _spec(tmp_path, "Gemma2ForCausalLM", **four, attn_logit_softcapping=50.0)
    assert g2.windows == (32, None, 32, None) and g2.attn_softcap == 50.0
    assert g2.max_position == 512  # the window is computed, not a cap on the context
    assert g2.query_scale == 16**-0.5 and g2.sandwich_norms and not g2.qk_norm
    six = {**four, "num_hidden_layers": 7}  # Gemma 3: five sliding of each six
    g3 = _spec(tmp_path, "Gemma3ForCausalLM", **six, query_pre_attn_scalar=4, rope_theta=1e6)
    assert g3.windows == (32,) * 5 + (None, 32) and g3.qk_norm and g3.query_scale == 0.5
    assert (g3.rope_theta, g3.local_rope_theta) == (1e6, 10000.0)
    nested = {  # transformers 5 writes one RoPE set a layer type
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
    }
    g3 = _spec(tmp_path, "Gemma3ForCausalLM", **six, rope_parameters=nested)
    assert g3.rope_scaling["factor"] == 8.0 and g3.local_rope_theta == 1e4
    g1 = _spec(tmp_path, "GemmaForCausalLM", head_dim=16)
    assert g1.gemma and not g1.sandwich_norms and g1.windows == ()
    with pytest.raises(ModelLoadError, match="hidden_activation 'silu'"):
        _spec(tmp_path, "Gemma2ForCausalLM", **four, hidden_activation="silu")
    with pytest.raises(ModelLoadError, match="use_bidirectional_attention"):
        _spec(tmp_path, "Gemma3ForCausalLM", **four, use_bidirectional_attention=True)
    with pytest.raises(ModelLoadError, match=r"layer_types \['chunked_attention'\]"):
        _spec(tmp_path, "Gemma3ForCausalLM", **four, layer_types=["chunked_attention"] * 4)
    sliding_yarn = {**nested, "sliding_attention": {"rope_type": "yarn", "rope_theta": 1e4}}
    with pytest.raises(ModelLoadError, match="sliding layers' rope_type 'yarn'"):
        _spec(tmp_path, "Gemma3ForCausalLM", **four, rope_parameters=sliding_yarn)


PUBLISHED = {
    "fp8": {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]},
    "awq": {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True},
    "gptq": {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False},
}


@pytest.mark.parametrize("method", PUBLISHED)
def test_a_checkpoints_own_fp8_awq_or_gptq_quantization_is_read(tmp_path: Path, method: str):
    config = {**BASE, "architectures": ["LlamaForCausalLM"]}
    assert read_quant_config({**config, "quantization_config": PUBLISHED[method]}, tmp_path)
    assert read_quant_config(config, tmp_path) is None


@pytest.mark.parametrize(
    ("method", "change", "named"),
    [
        ("gptq", {"quant_method": "bitsandbytes"}, "quant_method 'bitsandbytes'"),
        ("gptq", {"quant_method": "compressed-tensors"}, "quant_method 'compressed-tensors'"),
        ("gptq", {"bits": 8}, "bits 8"),
        ("gptq", {"group_size": 16}, "group_size 16"),
        ("gptq", {"checkpoint_format": "marlin"}, "checkpoint_format 'marlin'"),
        ("awq", {"version": "gemv"}, "version 'gemv'"),
        ("awq", {"zero_point": False}, "zero_point False"),
        ("fp8", {"fmt": "e5m2"}, "fmt 'e5m2'"),
        ("fp8", {"weight_block_size": [128]}, r"weight_block_size \[128\]"),
    ],
)
def test_a_checkpoints_quantization_the_engine_cannot_read_is_refused_naming_its_key(
    tmp_path: Path, method: str, change: dict[str, Any], named: str
) -> None:
    """Its tensors are codes and scales in a form not read here: refused at load, never
    read as floats into wrong arithmetic."""
    config = {**PUBLISHED[method], **change}
    with pytest.raises(ModelLoadError, match=f"quantization_config {named} .* quantization int8"):
        _spec(tmp_path, "LlamaForCausalLM", quantization_config=config)


def test_mixtral_and_qwen3_moe_read_their_experts_and_dense_layers_among_them_are_refused(
    tmp_path: Path,
) -> None:
    mixtral = _spec(tmp_path, "MixtralForCausalLM", num_local_experts=8, num_experts_per_tok=2)
    assert (mixtral.experts, mixtral.experts_per_token, mixtral.expert_size) == (8, 2, 128)
    assert mixtral.renormalize_experts and not mixtral.qk_norm
    moe = {"num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 32}
    qwen = _spec(tmp_path, "Qwen3MoeForCausalLM", head_dim=16, **moe)
    assert (qwen.experts, qwen.experts_per_token, qwen.expert_size) == (128, 8, 32)
    assert qwen.qk_norm and not qwen.renormalize_experts  # norm_topk_prob's default
    assert _spec(tmp_path, "Qwen3MoeForCausalLM", norm_topk_prob=True, **moe).renormalize_experts
    assert not _spec(tmp_path, "LlamaForCausalLM").experts
    with pytest.raises(ModelLoadError, match="decoder_sparse_step 2"):
        _spec(tmp_path, "Qwen3MoeForCausalLM", decoder_sparse_step=2, **moe)
    with pytest.raises(ModelLoadError, match=r"mlp_only_layers \[0\]"):
        _spec(tmp_path, "Qwen3MoeForCausalLM", mlp_only_layers=[0], **moe)


def test_a_gguf_missing_a_key_its_family_needs_is_refused_naming_it() -> None:
    # The header alone (no tensors): a gemma2 file without its sliding window, a qwen3moe
    # one without how many experts a token takes.
    from types import SimpleNamespace

    from cluster.engine.model.checkpoint import _gguf_spec

    def header(arch: str, **extra: Any) -> Any:
        shape = {"attention.head_count": 4, "embedding_length": 64, "feed_forward_length": 128,
                 "block_count": 2, "attention.layer_norm_rms_epsilon": 1e-6,
                 "context_length": 512, "vocab_size": 512, **extra}  # fmt: skip
        fields = {f"{arch}.{k}": v for k, v in shape.items()}
        fields |= {"general.architecture": arch, "tokenizer.ggml.eos_token_id": 2}
        return SimpleNamespace(fields=fields, tensors=[])

    with pytest.raises(ModelLoadError, match=r"gemma2\.attention\.sliding_window is missing"):
        _gguf_spec(header("gemma2"), Path("g.gguf"))
    assert _gguf_spec(header("gemma2", **{"attention.sliding_window": 8}), Path("g")).windows
    with pytest.raises(ModelLoadError, match=r"qwen3moe\.expert_used_count is missing"):
        _gguf_spec(header("qwen3moe", expert_count=8), Path("q.gguf"))
