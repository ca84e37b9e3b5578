"""The inference engine: model, paged KV cache, scheduler, sampler. The only engine code."""

from cluster.engine.engine import LLMEngine

__all__ = ["LLMEngine"]
