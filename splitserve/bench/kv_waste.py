"""KV memory reserved but never written, paged versus contiguous, over one request set.

A request's KV is written for prompt + output tokens. Paged, it holds whole pages.
Contiguous, it holds a slab sized up front: its prompt plus max_tokens (a server that
knows the prompt but not where the reply ends), or one fixed slab per sequence sized for
the longest request the server accepts (the workload's, or the model's max context).
`fits` is how many sequences of the set's mean reservation one KV budget holds at once.
"""

from __future__ import annotations

from dataclasses import dataclass

from cluster.engine.sched.page_pool import pages_for
from splitserve.workload import Request


@dataclass(frozen=True)
class KVWaste:
    layout: str
    reserved: int  # tokens, summed over the set
    used: int
    fits: int

    @property
    def waste(self) -> float:
        return 1 - self.used / self.reserved


def kv_waste(
    requests: list[Request],
    page_size: int,
    max_tokens: int,
    max_request_len: int,
    max_model_len: int,
    budget_tokens: int,
) -> list[KVWaste]:
    n = len(requests)
    reserved = {
        f"paged, {page_size}-token pages": sum(
            pages_for(r.total_len, page_size) * page_size for r in requests
        ),
        f"contiguous, prompt + max_tokens {max_tokens}": sum(
            len(r.prompt) + max_tokens for r in requests
        ),
        f"contiguous, slab of {max_request_len} (longest request)": max_request_len * n,
        f"contiguous, slab of {max_model_len} (max context)": max_model_len * n,
    }
    used = sum(r.total_len for r in requests)
    return [
        KVWaste(name, total, used, int(budget_tokens * n // total))
        for name, total in reserved.items()
    ]
