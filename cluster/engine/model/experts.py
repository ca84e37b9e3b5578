"""A decoder layer's MLP: one dense SwiGLU, or a Mixture-of-Experts of them.

Mixture-of-Experts (Mixtral, Qwen3-MoE): a router scores every expert for each token
(softmax in float32), the token goes to its `top_k` best, their weights renormalized to
sum to 1 where the model says so (Mixtral always; Qwen3-MoE by `norm_topk_prob`), and the
layer's output is the weighted sum of those experts' SwiGLUs. Only the experts some token
chose are computed, each over its own tokens at once: a decode step reads the weights of
the experts its batch routed to, not all of them. The arithmetic is transformers': the
experts taken in index order, each one's weighted rows added into the output.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from cluster.engine.model.quantization import Linear

SiluMul = Callable[[torch.Tensor], torch.Tensor]  # silu(gate) * up of [gate | up] rows


@dataclass
class DenseMlp:
    gate_up: Linear  # hidden -> 2 * intermediate
    down: Linear

    def __call__(self, h: torch.Tensor, silu_mul: SiluMul) -> torch.Tensor:
        return self.down(silu_mul(self.gate_up(h)))

    @property
    def tensors(self) -> list[torch.Tensor]:
        return [*self.gate_up.tensors, *self.down.tensors]


@dataclass
class Experts:
    router: Linear  # hidden -> one score per expert (float32, never quantized)
    experts: list[DenseMlp]  # the experts first, first + 1, ... (a TP rank's: its range)
    top_k: int
    renormalize: bool
    first: int = 0

    def __call__(self, h: torch.Tensor, silu_mul: SiluMul) -> torch.Tensor:
        weights = torch.softmax(self.router(h.float()), dim=-1)
        top, chosen = weights.topk(self.top_k, dim=-1)
        if self.renormalize:
            top = top / top.sum(dim=-1, keepdim=True)
        top = top.to(h.dtype)
        out = torch.zeros_like(h)
        held = range(self.first, self.first + len(self.experts))
        if h.shape[0] == 1:  # a batch-1 decode: its k experts in index order, nothing gathered
            for slot, e in sorted(enumerate(chosen[0].tolist()), key=lambda p: p[1]):
                if e in held:
                    out += self.experts[e - self.first](h, silu_mul) * top[:, slot, None]
            return out
        for e in chosen.unique().tolist():
            if e not in held:  # another rank's: its share comes in the MLP's all-reduce
                continue
            rows, slot = (chosen == e).nonzero(as_tuple=True)
            y = self.experts[e - self.first](h[rows], silu_mul)
            out.index_add_(0, rows, y * top[rows, slot, None])
        return out

    @property
    def tensors(self) -> list[torch.Tensor]:
        return [*self.router.tensors, *(t for e in self.experts for t in e.tensors)]


Mlp = DenseMlp | Experts
