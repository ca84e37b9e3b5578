"""A Llama-family decoder (Llama, Mistral, Qwen2, Qwen3, Phi-3, Mixtral, Qwen3-MoE, Gemma 1,
2 and 3) over a paged KV cache.

The numerics follow transformers' LlamaModel step for step (RMSNorm in float32,
rotate-half RoPE, SDPA), so greedy output is token-identical in float32. On CUDA the
residual add with the RMSNorm after it, RoPE of q and k, and silu(gate) * up run as one
fused Triton kernel each (cluster/engine/kernels/layer_kernels.py); the Triton attention backend
rotates q and k itself, in its KV store. On the CPU they are one C call each
(layer_kernels_cpu.py), where the C file builds, and where every matrix is on our integer
kernel the runner runs the layers in one C call (layer_loop.py) instead of `forward`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from cluster.engine.kernels import layer_kernels_cpu
from cluster.engine.kernels.attention import AttentionBackend
from cluster.engine.kernels.kv_cache import KVCache
from cluster.engine.kernels.layer_attention import LayerAttention
from cluster.engine.model.checkpoint import ModelSpec, Weights
from cluster.engine.model.experts import DenseMlp, Experts, Mlp
from cluster.engine.model.model_files import ModelLoadError
from cluster.engine.model.quantization import (
    FLOAT_STORED_AS,
    DenseLinear,
    Embedding,
    Fp8Rows,
    GroupQuant,
    Linear,
    Stacked,
    Stored,
    fp8_rows,
    linear,
    quantize,
    stackable,
)

if TYPE_CHECKING:  # torch.distributed loads only for a model split across ranks
    from cluster.engine.model.tensor_parallel import TensorGroup


@dataclass
class Layer:
    """One decoder layer's weights; each projection stored as the quantization mode says."""

    input_norm: torch.Tensor
    qkv: Linear  # hidden -> q + k + v: one matmul instead of three
    o: Linear
    post_norm: torch.Tensor
    mlp: Mlp  # dense, or a Mixture-of-Experts
    qk_norms: tuple[torch.Tensor, torch.Tensor] | None = None  # Qwen3's [head_dim] each
    # Gemma's norms of the attention's and the MLP's outputs, each before its residual add
    sandwich: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def tensors(self) -> list[torch.Tensor]:
        norms = [self.input_norm, self.post_norm, *(self.qk_norms or ()), *(self.sandwich or ())]
        return [*norms, *self.qkv.tensors, *self.o.tensors, *self.mlp.tensors]


def rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """transformers' rotate-half RoPE, x * cos + cat(-x2, x1) * sin, in four ops: the roll
    swaps the halves and `signed_sin` carries the minus (a sign flip is exact)."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * signed_sin


class LlamaModel:
    def __init__(
        self,
        spec: ModelSpec,
        weights: Weights,
        dtype: torch.dtype,
        device: torch.device,
        quantization: str = "none",
        group: TensorGroup | None = None,
    ) -> None:
        """Build from checkpoint weights, taking (and dropping) them from `weights` one
        by one so no float copy outlives its quantized form.

        `group`: this rank's share of a model split across ranks (tensor_parallel.py):
        `spec` is then the rank's shape (Shard.local) and `weights` its ShardedWeights."""
        self.spec = spec
        self.group = group
        # Fused elementwise steps: layer_kernels (Triton) on CUDA, layer_kernels_cpu (C)
        # on the CPU where it builds; else PyTorch's ops.
        self.kernels: ModuleType | None = None
        if device.type == "cuda":
            from cluster.engine.kernels import layer_kernels

            self.kernels = layer_kernels
        else:  # built only here: a GPU host compiles nothing for it
            self.kernels = layer_kernels_cpu.module(dtype)

        def take(name: str) -> Stored:
            if name not in weights:
                raise ModelLoadError(f"checkpoint {spec.name!r}: tensor {name} is missing")
            return weights.pop(name)

        def vec(name: str) -> torch.Tensor:
            t = take(name)
            assert isinstance(t, torch.Tensor), f"{name}: a vector is never quantized"
            return t.to(device=device, dtype=dtype)

        def norm(name: str) -> torch.Tensor:
            """An RMSNorm's weight; Gemma's multiply by 1 + w (added in float32)."""
            if not spec.gemma:
                return vec(name)
            return (1 + vec(name).float()).to(dtype)

        def matrix(*names: str, mode: str = quantization) -> Stored:
            """The named matrices stacked by rows: float, or groups as the mode keeps them."""
            return stored([take(n) for n in names], mode)

        def stored(parts: list[Stored], mode: str = quantization) -> Stored:
            floats = [p for p in parts if isinstance(p, torch.Tensor)]
            if len(floats) == len(parts):
                w = torch.cat(floats).to(device)
                # float as it is: gguf, awq, gptq left it float; on a GPU (fp8 the only
                # mode there) the FP8 GEMM's checkpoint left it float
                if mode not in FLOAT_STORED_AS or device.type != "cpu":
                    return w
                return quantize(w, FLOAT_STORED_AS[mode])
            if len(parts) == 1:  # groups or FP8 rows, as the checkpoint has them
                return parts[0]
            rows, groups = [], []  # a fused matrix mixing kinds: its float parts rounded
            for part in parts:  # to FP8 rows (an FP8 checkpoint) or 8-bit groups (a GGUF)
                if isinstance(part, Fp8Rows):
                    rows.append(part)
                elif isinstance(part, GroupQuant):
                    groups.append(part)
                elif device.type != "cpu":
                    rows.append(fp8_rows(part))
                else:
                    groups.append(quantize(part, "int8"))
            if rows and groups:
                raise ModelLoadError(f"checkpoint {spec.name!r}: FP8 and grouped parts in one")
            return Fp8Rows.cat(rows) if rows else GroupQuant.cat(groups)

        def mat(*names: str, bias: torch.Tensor | None = None) -> Linear:
            parts = [take(n) for n in names]
            if not stackable(parts):  # GPTQ act-order: each its own input order
                return Stacked([linear(stored([p]), None, dtype) for p in parts], bias)
            return linear(stored(parts), bias, dtype)

        def dense(at: str) -> DenseMlp:
            return DenseMlp(
                mat(at + "gate_proj.weight", at + "up_proj.weight"), mat(at + "down_proj.weight")
            )

        # The vocabulary matrices stay 8-bit in int4 mode, as llama.cpp's 4-bit files keep
        # them: at 4 bits they cost the bundled model 9% perplexity (measured), 8 bits 0.3%.
        vocab_mode = "int8" if quantization in ("int4", "awq", "gptq") else quantization
        embed_name = "model.embed_tokens.weight"

        def vocab_matrix(name: str) -> torch.Tensor | GroupQuant:
            m = matrix(name, mode=vocab_mode)
            if isinstance(m, Fp8Rows):  # FP8 checkpoints leave them float
                raise ModelLoadError(f"checkpoint {spec.name!r}: {name} in FP8 is not served")
            return m

        if spec.tie_embeddings:
            table = vocab_matrix(embed_name)
            self.lm_head = linear(table, None, dtype)
            # Tied: rows are looked up from what the head holds (a view when it is float).
            held = self.lm_head
            self.embed = Embedding(held.w.t() if isinstance(held, DenseLinear) else table, dtype)
        else:
            self.lm_head = linear(vocab_matrix("lm_head.weight"), None, dtype)
            table = vocab_matrix(embed_name)
            self.embed = Embedding(
                table.to(dtype) if isinstance(table, torch.Tensor) else table, dtype
            )
        self.norm = norm("model.norm.weight")
        self.layers: list[Layer] = []
        for i in range(spec.num_layers):
            p = f"model.layers.{i}."
            att = p + "self_attn."
            bias = None
            if spec.qkv_bias:
                bias = torch.cat([vec(att + f"{n}_proj.bias") for n in "qkv"])
            qk_norms = None
            if spec.qk_norm:
                qk_norms = (norm(att + "q_norm.weight"), norm(att + "k_norm.weight"))
            sandwich, post_norm = None, p + "post_attention_layernorm.weight"
            if spec.sandwich_norms:  # its post_attention_layernorm norms attention's output
                sandwich = (norm(post_norm), norm(p + "post_feedforward_layernorm.weight"))
                post_norm = p + "pre_feedforward_layernorm.weight"
            mlp: Mlp
            if spec.experts:  # the router in float32 (vLLM keeps it float, softmax in float32)
                first, end = (0, spec.experts) if group is None else group.shard.experts
                mlp = Experts(
                    linear(take(p + "mlp.gate.weight"), None, torch.float32),
                    [dense(p + f"mlp.experts.{e}.") for e in range(first, end)],
                    spec.experts_per_token,
                    spec.renormalize_experts,
                    first,
                )
            else:
                mlp = dense(p + "mlp.")
            self.layers.append(
                Layer(
                    input_norm=norm(p + "input_layernorm.weight"),
                    qkv=mat(*(att + f"{n}_proj.weight" for n in "qkv"), bias=bias),
                    o=mat(att + "o_proj.weight"),
                    post_norm=norm(post_norm),
                    mlp=mlp,
                    qk_norms=qk_norms,
                    sandwich=sandwich,
                )
            )
        vocab = spec.vocab_size if group is None else group.shard.vocab_width
        expected = (vocab, spec.hidden_size)
        if tuple(self.embed.shape) != expected:
            raise ModelLoadError(
                f"checkpoint {spec.name!r}: embed_tokens has shape {tuple(self.embed.shape)}, "
                f"config says {expected}"
            )
        self.cos, self.signed_sin = self._rope_tables(spec.rope_inv_freq(), device, dtype)
        # The RoPE tables, the model's first; each layer's index into them (Gemma 3's
        # sliding layers rotate by their own).
        self.rope_tables = [(self.cos, self.signed_sin)]
        self.layer_table = [0] * spec.num_layers
        if spec.local_rope_theta is not None:
            self.rope_tables.append(
                self._rope_tables(spec.rope_inv_freq(local=True), device, dtype)
            )
            self.layer_table = [int(w is not None) for w in spec.windows]
        # sqrt(hidden_size) in the activations' dtype, as Gemma's embedding multiplies
        self.embed_scale = torch.tensor(spec.hidden_size**0.5, dtype=dtype) if spec.gemma else None

    def _rope_tables(
        self, inv_freq: torch.Tensor, device: torch.device, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin [max_position, head_dim] of these frequencies (`rotate`)."""
        freqs = torch.outer(torch.arange(self.spec.max_position).float(), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        signed_sin = torch.cat((-freqs.sin(), freqs.sin()), dim=-1)
        return emb.cos().to(device=device, dtype=dtype), signed_sin.to(device, dtype)

    def attention_layers(self) -> tuple[LayerAttention, ...]:
        """Each layer's attention where any is not PLAIN (Gemma 2's and 3's), else ()."""
        s = self.spec
        if not s.sandwich_norms:
            return ()
        return tuple(
            LayerAttention(
                scale=s.query_scale,
                window=s.windows[i],
                softcap=s.attn_softcap,
                rope=self.rope_tables[self.layer_table[i]] if self.layer_table[i] else None,
            )
            for i in range(s.num_layers)
        )

    @property
    def tensors(self) -> list[torch.Tensor]:
        """Every tensor the model holds, once (a tied embedding's view is not counted)."""
        held = [self.norm, *self.lm_head.tensors]
        if not isinstance(self.embed.table, torch.Tensor) or not self.spec.tie_embeddings:
            held += self.embed.tensors
        return held + [t for layer in self.layers for t in layer.tensors]

    @property
    def weight_bytes(self) -> int:
        """Resident bytes of the weights, as stored (packed, scales and all)."""
        return sum(t.numel() * t.element_size() for t in self.tensors)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [N]
        positions: torch.Tensor,  # [N]
        attention: AttentionBackend,
        metadata: Any,  # attention.prepare's for this step
        cache: KVCache,
        logits_rows: torch.Tensor,  # rows whose next-token logits are wanted
        on_layer: Callable[[int], None] | None = None,  # after layer i's KV is in the cache(s)
    ) -> torch.Tensor:
        s = self.spec
        rows = None if attention.fuses_rope else self.rope_rows(positions)
        x, mlp = self.embed_tokens(input_ids), None
        for i in range(len(self.layers)):
            x, qkv = self.before_attention(i, x, mlp)
            qk, v = self.heads(qkv)
            if s.qk_norm:
                qk = self.norm_heads(i, qk)
            if not attention.fuses_rope:  # else attention rotates q and k as it stores k
                qk = self.rope(i, qk, positions, rows)  # q and k together: one RoPE
            a = attention.forward(i, qk[:, : s.num_heads], qk[:, s.num_heads :], v, cache, metadata)
            if on_layer is not None and self.group is None:
                on_layer(i)
            x, mlp = self.after_attention(i, x, a)
            if on_layer is not None and self.group is not None:
                on_layer(i)  # past the layer's all-reduces: every rank's KV of layer i is in
        assert mlp is not None
        return self.logits(x, mlp, logits_rows)

    # The step cut at attention (cluster/engine/cuda_graphs.py captures the pieces between).

    def before_attention(
        self, i: int, x: torch.Tensor, mlp: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i up to attention: (the residual, with the previous layer's MLP output
        added (none before layer 0), and the qkv projection of its RMSNorm)."""
        layer = self.layers[i]
        if mlp is None:
            h = self.first_norm(x)
        else:
            x, h = self._add_norm(x, mlp, layer.input_norm)
        return x, layer.qkv(h)

    def first_norm(self, x: torch.Tensor) -> torch.Tensor:
        """Layer 0's input RMSNorm (no residual to add yet)."""
        return self._norm(x, self.layers[0].input_norm)

    def heads(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of the qkv projection: q's and k's heads side by side [n, heads +
        kv_heads, head_dim], v's [n, kv_heads, head_dim]."""
        s, n = self.spec, qkv.shape[0]
        split = (s.num_heads + s.num_kv_heads) * s.head_dim
        return qkv[:, :split].view(n, -1, s.head_dim), qkv[:, split:].view(n, -1, s.head_dim)

    def norm_heads(self, i: int, qk: torch.Tensor) -> torch.Tensor:
        """Qwen3's RMSNorm over each head of q and of k (layer i's two weights), before RoPE."""
        norms = self.layers[i].qk_norms
        assert norms is not None
        h, eps, d = self.spec.num_heads, self.spec.rms_norm_eps, (self.spec.head_dim,)
        if self.kernels is not None:  # in place, as the C layer loop does
            self.kernels.rms_norm_heads_(qk[:, :h], norms[0], eps)
            self.kernels.rms_norm_heads_(qk[:, h:], norms[1], eps)
            return qk
        q = F.rms_norm(qk[:, :h], d, norms[0], eps)
        return torch.cat([q, F.rms_norm(qk[:, h:], d, norms[1], eps)], 1)

    def after_attention(
        self, i: int, x: torch.Tensor, a: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i from attention's output a: (the residual with the output projection
        added, the MLP of its RMSNorm, not yet added)."""
        layer = self.layers[i]
        o = self._sum(layer.o(a.reshape(a.shape[0], -1)))
        if layer.sandwich is not None:
            o = self._norm_(o, layer.sandwich[0])
        x, h = self._add_norm(x, o, layer.post_norm)
        mlp = self._sum(layer.mlp(h, self._gelu_mul if self.spec.gemma else self._silu_mul))
        return x, mlp if layer.sandwich is None else self._norm_(mlp, layer.sandwich[1])

    def logits(self, x: torch.Tensor, mlp: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Float32 next-token logits of the given rows, from the last layer's residual and
        MLP output."""
        x = self._norm(x[rows] + mlp[rows], self.norm)
        logits = self.lm_head(x).float()
        logits = logits if self.group is None else self.group.gather_vocab(logits)
        cap = self.spec.final_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (self.spec.hidden_size,), weight, self.spec.rms_norm_eps)

    def _norm_(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """x [N, hidden] RMSNorm'd, in place where the layer kernels are (as the C layer loop
        norms Gemma's sublayer outputs: its rows as heads of one)."""
        if self.kernels is None:
            return self._norm(x, weight)
        self.kernels.rms_norm_heads_(x.unsqueeze(1), weight, self.spec.rms_norm_eps)
        return x

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        """The tokens' embedding rows; split across ranks, each looks up the ids in its
        slice of the vocabulary, zeros elsewhere, and the sum is the row (exactly)."""
        if self.group is None:
            x = self.embed(ids)
        else:
            start, end = self.group.shard.vocab
            local = ids - start
            inside = (local >= 0) & (local < end - start)
            x = self.embed(torch.where(inside, local, 0))
            x = self.group.all_reduce(x * inside.unsqueeze(1).to(x.dtype))
        return x if self.embed_scale is None else x * self.embed_scale

    def _sum(self, partial: torch.Tensor) -> torch.Tensor:
        """A row-parallel projection's output: its ranks' partial sums added up."""
        return partial if self.group is None else self.group.all_reduce(partial)

    def _add_norm(
        self, x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + delta, RMSNorm(x + delta) * weight)."""
        if self.kernels is not None:  # x += delta in place
            return x, self.kernels.add_rms_norm(x, delta, weight, self.spec.rms_norm_eps)
        x = x + delta
        return x, F.rms_norm(x, (self.spec.hidden_size,), weight, self.spec.rms_norm_eps)

    def rope_rows(self, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        """The rows' cos and signed sin for `rope` from each of `rope_tables`, gathered once
        a step; None where a fused kernel reads the tables by position."""
        if self.kernels is not None:
            return None
        return [(c[positions].unsqueeze(1), s[positions].unsqueeze(1)) for c, s in self.rope_tables]

    def rope(
        self,
        i: int,
        qk: torch.Tensor,
        positions: torch.Tensor,
        rows: list[tuple[torch.Tensor, torch.Tensor]] | None,  # rope_rows'
    ) -> torch.Tensor:
        """Layer i's q and k rotated: in place by a fused kernel, else by `rotate`'s four
        ops."""
        table = self.layer_table[i]
        if rows is None:
            assert self.kernels is not None
            self.kernels.rope_(qk, positions, *self.rope_tables[table])
            return qk
        return rotate(qk, *rows[table])

    def _gelu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """Gemma's gating: GELU (tanh approximation) of the gate times up."""
        if self.kernels is not None:
            out: torch.Tensor = self.kernels.gelu_mul(gate_up)
            return out
        gate, up = gate_up.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up

    def _silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self.kernels is not None:
            out: torch.Tensor = self.kernels.silu_mul(gate_up)
            return out
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up
