"""The KV-connector seam: how an engine tells a sink (the prefill role's KV sender) where
each request's KV is, without the sink touching the engine's pages or sequences.

Events, in the order a step makes them:
- `KVStored`, once per layer of each step with one event per request in the step: "the KV
  of the first `num_tokens` tokens of request R, for `layers`, is queued into `pages`".
  The device has written it once `ready.done()`; nothing waits on it.
- `PromptDone`, after the step that computed the last prompt token and sampled the first
  token, once per request.

Page ownership: the engine alone owns its pages and their reference counts. The pages of
an event are the request's for as long as the step runs; a sink that needs them later
(a WRITE reads them) holds them from inside `KVSink.stored` with `PageHolds.hold`, and
gives each hold back once with `PageHolds.release`. Held pages are never reused or
evicted, whatever becomes of the request meanwhile (finished, aborted, or preempted and
recomputed into other pages), so a WRITE in flight always reads the KV it was planned
for. A hold is per event, not per request: the engine can always make progress, since
a sink holds pages only while its WRITEs of them are in flight.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch

from cluster.engine.layer_ready import LayerReady
from cluster.engine.sched.page_pool import PagePool, pages_for
from cluster.engine.sched.scheduler import Step
from cluster.types import PageId, RequestId, SampledToken


class KVStored(NamedTuple):
    """The KV of the first `num_tokens` tokens of `request_id` (of a `num_prompt`-token
    prompt), for `layers`, is queued into `pages`: the request's page table from its first
    page up to the one holding token `num_tokens - 1`. (A NamedTuple: one is made per
    request per layer, and it costs a fifth of a frozen dataclass.)"""

    request_id: RequestId
    layers: range
    num_tokens: int
    num_prompt: int
    pages: tuple[PageId, ...]
    ready: LayerReady  # passed once the device has written these layers


@dataclass(frozen=True)
class PromptDone:
    """The request's prompt KV is all stored and its first token sampled."""

    request_id: RequestId
    first: SampledToken


class KVSink(Protocol):
    def stored(self, events: Sequence[KVStored]) -> None:
        """Layer(s) of one step are queued: one event per request in the step. Runs on the
        engine's thread between two layers, so it must not wait (on the device or the
        network). The events' pages are free for reuse after it returns unless held."""

    def prompt_done(self, event: PromptDone) -> None:
        """The request's prompt is done; comes after its last `stored` event."""


class PageHolds:
    """Pages a sink keeps past the step that reported them, one reference per hold."""

    def __init__(self, pool: PagePool) -> None:
        self._pool = pool
        self._held: Counter[PageId] = Counter()

    @property
    def num_held(self) -> int:
        """Holds not yet released (a page held twice counts twice)."""
        return self._held.total()

    def hold(self, pages: Sequence[PageId]) -> None:
        """Keep `pages`, which the current `stored` events report, until released."""
        self._pool.retain(pages)
        self._held.update(pages)

    def release(self, pages: Sequence[PageId]) -> None:
        """Give back one hold on each of `pages`; each must be held."""
        for page in pages:
            n = self._held.pop(page, 0)
            assert n > 0, f"page {page} released but not held"
            if n > 1:
                self._held[page] = n - 1
        self._pool.free(pages)


def layer_hook(
    step: Step, page_size: int, device: torch.device, sink: KVSink
) -> Callable[[int], None]:
    """The runner's hook for one step: once layer i is queued, mark the stream and tell
    the sink where each request's KV for layer i is."""
    stored = [
        (
            seq.request_id,
            seq.num_computed + n,
            seq.num_prompt,
            tuple(seq.pages[: pages_for(seq.num_computed + n, page_size)]),
        )
        for seq, n in [*step.prefills, *((s, 1) for s in step.decodes)]
    ]

    def on_layer(i: int) -> None:
        ready = LayerReady(device)
        layers = range(i, i + 1)
        sink.stored([KVStored(rid, layers, n, p, pages, ready) for rid, n, p, pages in stored])

    return on_layer
