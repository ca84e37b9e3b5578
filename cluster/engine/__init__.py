"""The inference engine, in three rooms and the step that uses them:

- `sched/`: which tokens run next and where their KV lives (scheduler, page pool and
  prefix cache, block tables, sequences, KV events, the step-cost fit): plain Python.
- `kernels/`: how a step's arithmetic runs (the KV cache tensors, attention backends,
  the C and Triton kernels and the native build); it may read `sched/`'s page math.
- `model/`: what is computed (the model, checkpoints and GGUF, quantization, tokenizer,
  tensor parallelism); it calls `kernels/`.
- here: the engine (`engine.py`), the runner and its compiled steps (`runner.py`,
  `cuda_graphs.py`, `layer_loop.py`: they capture or loop the whole model, so they stand
  above `model/`), sampling, grammars and the KV sink.

Imports point down the rooms (sched < kernels < model < here; tests/unit/test_layers.py).
Import modules by name (`cluster.engine.engine.LLMEngine`): no package here imports
anything itself, so the router can load `cluster.engine.model.tokenizer` without torch.
"""
