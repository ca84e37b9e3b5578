"""One request inside an engine: its tokens, its pages, how far its KV is computed."""

from __future__ import annotations

from dataclasses import dataclass, field

from cluster.engine.sched.page_pool import hash_pages
from cluster.types import BlockHash, FinishReason, PageId, RequestId, RequestStatus, SamplingParams


@dataclass(eq=False)
class Sequence:
    request_id: RequestId
    token_ids: list[int]  # prompt, then generated tokens
    num_prompt: int
    sampling: SamplingParams
    status: RequestStatus = RequestStatus.WAITING
    pages: list[PageId] = field(default_factory=list)  # page table: logical page i -> pages[i]
    num_computed: int = 0  # leading tokens whose KV is in `pages`
    num_cached: int = 0  # prompt tokens found in the prefix cache at first admission
    num_registered: int = 0  # leading full pages recorded in the prefix cache
    num_preemptions: int = 0
    finish_reason: FinishReason | None = None
    logprobs: list[float] = field(default_factory=list)
    _hashes: list[BlockHash] = field(default_factory=list)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt :]

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed

    def page_hashes(self, num_pages: int, page_size: int) -> list[BlockHash]:
        """Hash chain of the first `num_pages` full pages, extended incrementally."""
        have = len(self._hashes)
        if num_pages > have:
            parent = self._hashes[-1] if self._hashes else None
            tokens = self.token_ids[have * page_size : num_pages * page_size]
            self._hashes.extend(hash_pages(tokens, page_size, parent))
        return self._hashes[:num_pages]
