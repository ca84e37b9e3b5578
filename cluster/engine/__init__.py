"""The inference engine: model, paged KV cache, scheduler, sampler. The only engine code.

Import its modules by name (`cluster.engine.engine.LLMEngine`): this package imports
nothing itself, so the router can load `cluster.engine.tokenizer` without torch.
"""
