"""A CPU step's decoder layers in one C call (layer_loop.c), where the model can take it.

An eager CPU step calls our C kernels about 20 times a layer from Python, each call a
few microseconds of ctypes, tensor views and PyTorch dispatch: 2.4-2.8 ms of a 6.9-8.0 ms
batch-1 step of the bundled model (interleaved; docs/benchmarks.md). The loop runs the same kernels
in the same order from C, so its steps are the eager steps bit for bit (tests compare
them) and a row's numbers still depend on that row alone. It takes every step, decodes
and prefill chunks alike: a step that took another path would round differently.

It runs where every matrix is on our integer kernel (qmatmul.c) and attention on
paged_attention.c, the model on one rank; elsewhere (float weights, torch's int4 kernel,
tensor parallelism, CUDA) the eager forward runs. Chosen over a compiled graph (inductor,
AOTInductor): what is left between the kernels is glue that a graph compiler cannot fuse
into our C kernels, and compiling takes long here: vLLM's inductor compile of this model
took 54 s on a 2-core host where gcc builds this file in 0.3 s (native.py caches it).
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from typing import Any

import torch

from cluster.engine.kernels import layer_kernels_cpu, native, qmatmul
from cluster.engine.kernels.attention import AttentionBackend
from cluster.engine.kernels.attention_cpu import CpuBackend, CpuMetadata
from cluster.engine.kernels.kv_cache import KVCache
from cluster.engine.kernels.layer_attention import PLAIN
from cluster.engine.model.experts import DenseMlp
from cluster.engine.model.model import LlamaModel
from cluster.engine.model.quantization import BlockLinear

i64, ptr = ctypes.c_int64, ctypes.c_void_p


class _Matrix(ctypes.Structure):
    _fields_ = [("packed", ptr), ("rows", i64), ("bits", i64), ("bias", ptr)]


class _Layer(ctypes.Structure):
    _fields_ = [
        ("input_norm", ptr),
        ("post_norm", ptr),
        ("qkv", _Matrix),
        ("o", _Matrix),
        ("gate_up", _Matrix),
        ("down", _Matrix),
        ("k_cache", ptr),
        ("v_cache", ptr),
        ("q_norm", ptr),
        ("k_norm", ptr),
        *((name, ptr) for name in ("attn_out_norm", "mlp_out_norm", "cos", "signed_sin")),
        ("scale", ctypes.c_double),
        ("softcap", ctypes.c_double),
        ("window", i64),
    ]


class _Model(ctypes.Structure):
    _fields_ = [
        *((name, i64) for name in ("hidden", "heads", "kv_heads", "dim", "inner", "page_size")),
        ("bf16", i64),
        ("kv_kind", i64),
        ("eps", ctypes.c_double),
        ("cos", ptr),
        ("signed_sin", ptr),
        *((name, ptr) for name in ("qmatmul", "paged_attention", "paged_prefill")),
        *((name, ptr) for name in ("add_rms_norm", "rope", "act_mul", "rms_norm_heads")),
        ("layers", ptr),
    ]


class _Step(ctypes.Structure):
    _fields_ = [
        ("n", i64),
        ("positions", ptr),
        ("slots", ptr),
        ("decodes", i64),
        ("decode_pages", ptr),
        ("decode_lens", ptr),
        ("decode_width", i64),
        ("chunks", i64),
        ("chunk", ptr),
        *((name, ptr) for name in ("x", "h", "delta", "qkv", "a", "gate_up", "act", "qf", "af")),
    ]


@functools.cache
def _library() -> ctypes.CDLL | None:
    lib = native.library("layer_loop.c")
    if lib is None:
        return None
    lib.layer_loop.restype = ctypes.c_int
    lib.layer_loop.argtypes = [ctypes.POINTER(_Model), ctypes.POINTER(_Step), i64, i64]
    return lib


def _address(fn: Any) -> int | None:  # a loaded C function
    return ctypes.cast(fn, ptr).value


def _matrix(m: BlockLinear) -> _Matrix:
    bias = None if m.bias is None else m.bias.data_ptr()
    return _Matrix(m.packed.data_ptr(), m.rows, m.bits, bias)


class LayerLoop:
    """The layers of `model` over `cache`, stepped by `forward`. Holds raw pointers into both:
    it lives as long as the runner that holds them."""

    def __init__(
        self, lib: ctypes.CDLL, model: LlamaModel, cache: KVCache, attention: CpuBackend
    ) -> None:
        ops, matmul = layer_kernels_cpu._ops(), qmatmul.kernel()
        assert ops is not None and matmul is not None and attention.kernel is not None
        s, layout = model.spec, cache.layout
        self.lib, self.model = lib, model
        self.dtype = model.cos.dtype  # the activations'
        layers = []
        attention_layers = model.attention_layers() or (PLAIN,) * len(model.layers)

        def address(t: torch.Tensor | None) -> int | None:
            return None if t is None else t.data_ptr()

        for i, layer in enumerate(model.layers):
            assert isinstance(layer.mlp, DenseMlp), "experts: not in layer_loop.c"
            mats = (layer.qkv, layer.o, layer.mlp.gate_up, layer.mlp.down)
            blocks = [_matrix(m) for m in mats if isinstance(m, BlockLinear)]
            assert len(blocks) == len(mats), "every matrix on qmatmul.c"
            attn = attention_layers[i]
            q_norm, k_norm = layer.qk_norms or (None, None)
            out_norms = layer.sandwich or (None, None)
            cos, signed_sin = attn.rope or (None, None)
            layers.append(
                _Layer(
                    layer.input_norm.data_ptr(),
                    layer.post_norm.data_ptr(),
                    *blocks,
                    cache.k[i].data_ptr(),
                    cache.v[i].data_ptr(),
                    *map(address, (q_norm, k_norm, *out_norms, cos, signed_sin)),
                    attn.scale_for(s.head_dim),
                    attn.softcap or 0.0,
                    attn.window or 0,
                )
            )
        self._layers = (_Layer * len(layers))(*layers)
        self._model = _Model(
            s.hidden_size,
            s.num_heads,
            s.num_kv_heads,
            s.head_dim,
            s.intermediate_size,
            layout.page_size,
            int(self.dtype == torch.bfloat16),
            layout.kind,
            s.rms_norm_eps,
            model.cos.data_ptr(),
            model.signed_sin.data_ptr(),
            _address(matmul.qmatmul),
            _address(attention.kernel.paged_attention),
            _address(attention.kernel.paged_prefill),
            _address(ops.add_rms_norm),
            _address(ops.rope),
            _address(ops.gelu_mul if s.gemma else ops.silu_mul),
            _address(ops.rms_norm_heads),
            ctypes.cast(self._layers, ptr),
        )

    def forward(
        self,
        ids: torch.Tensor,  # [N]
        positions: torch.Tensor,  # [N]
        metadata: CpuMetadata,
        logits_rows: torch.Tensor,
        on_layer: Callable[[int], None] | None = None,  # after layer i's KV is in the cache
    ) -> torch.Tensor:
        """model.forward's logits, the layers run by layer_loop.c (one call, or one a layer
        for `on_layer`)."""
        model, s, n = self.model, self.model.spec, ids.shape[0]
        x = model.embed_tokens(ids)
        h = model.first_norm(x)
        q = s.num_heads * s.head_dim

        def empty(*shape: int, dtype: torch.dtype = self.dtype) -> torch.Tensor:
            return torch.empty(shape, dtype=dtype)

        delta, act = empty(n, s.hidden_size), empty(n, s.intermediate_size)
        qkv = empty(n, self._layers[0].qkv.rows)
        gate_up = empty(n, 2 * s.intermediate_size)
        # af also stages 8-bit pages' K and V rows (layer_loop.c: store_kv)
        staged = 2 * s.num_kv_heads * s.head_dim
        qf, af = empty(n, q, dtype=torch.float32), empty(n, max(q, staged), dtype=torch.float32)
        a = empty(n, q)
        positions = positions.contiguous()
        decodes, chunks = metadata.num_decodes, metadata.prefills
        pages = [c.pages.contiguous() for c in chunks]  # held till the step is done
        chunk = torch.tensor(
            [
                [c.start, c.num_tokens, c.context_len, p.data_ptr()]
                for c, p in zip(chunks, pages, strict=True)
            ],
            dtype=torch.int64,
        )
        d_pages, d_lens = metadata.decode_pages, metadata.decode_lens
        assert not decodes or (d_pages is not None and d_lens is not None)
        step = _Step(
            n,
            positions.data_ptr(),
            metadata.slot_mapping.data_ptr(),
            decodes,
            None if d_pages is None else d_pages.data_ptr(),
            None if d_lens is None else d_lens.data_ptr(),
            0 if d_pages is None else d_pages.shape[1],
            len(chunks),
            chunk.data_ptr(),
            *(t.data_ptr() for t in (x, h, delta, qkv, a, gate_up, act, qf, af)),
        )
        spans = (
            [(0, len(model.layers))]
            if on_layer is None
            else [(i, i + 1) for i in range(len(model.layers))]
        )
        for first, last in spans:
            if self.lib.layer_loop(ctypes.byref(self._model), ctypes.byref(step), first, last):
                raise MemoryError("layer_loop: a kernel had no scratch memory")
            if on_layer is not None:
                on_layer(first)
        return model.logits(x, delta, logits_rows)


def build(model: LlamaModel, cache: KVCache, attention: AttentionBackend) -> LayerLoop | None:
    """The loop for this model where it can take every step (module docstring), else None."""
    mats = [m for layer in model.layers for m in (layer.qkv, layer.o)]
    mlps = [layer.mlp for layer in model.layers]
    mats += [m for mlp in mlps if isinstance(mlp, DenseMlp) for m in (mlp.gate_up, mlp.down)]
    if (
        model.group is not None
        or model.spec.experts  # a Mixture-of-Experts' routing: not in layer_loop.c yet
        or model.kernels is None  # the C layer ops, built for the model's dtype
        or model.kernels is not layer_kernels_cpu.module(model.cos.dtype)
        or not isinstance(attention, CpuBackend)
        or attention.kernel is None
        or not all(isinstance(m, BlockLinear) for m in mats)
        or not (cache.layout.dtype == model.cos.dtype or cache.layout.scaled)
    ):
        return None
    lib = _library()
    return None if lib is None else LayerLoop(lib, model, cache, attention)
