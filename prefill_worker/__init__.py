"""The prefill role: compute prompts' KV in batches and push it into decode workers' pages."""
