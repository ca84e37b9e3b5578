"""Scheduling: which tokens run next and which pages hold their KV. Plain Python over
plain data; imports nothing else of the engine."""
