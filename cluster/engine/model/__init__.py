"""The model: its layers, checkpoints (safetensors, GGUF), quantization, tokenizer and
tensor parallelism. Imports `kernels/` and `sched/` of the engine, never the engine's step."""
