"""splitserve: LLM serving with disaggregated prefill and decode."""
