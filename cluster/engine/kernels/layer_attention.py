"""What one layer's attention computes beyond causal softmax(q k^T / sqrt(head_dim)) V:
read by every attention backend (attention.py's seam) and built by the model."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LayerAttention:
    """How one layer's attention differs from causal softmax(q k^T / sqrt(head_dim)) V over
    its whole context (Gemma's layers; every other family's are `PLAIN`)."""

    scale: float | None = None  # multiplies q . k; None: head_dim ** -0.5
    window: int | None = None  # the last `window` tokens only, the query's own included
    softcap: float | None = None  # scores (scaled) -> softcap * tanh(scores / softcap)
    rope: tuple[torch.Tensor, torch.Tensor] | None = None  # cos, signed sin; None: the model's

    def scale_for(self, head_dim: int) -> float:
        return head_dim**-0.5 if self.scale is None else self.scale


PLAIN = LayerAttention()
