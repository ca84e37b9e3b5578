"""LayerReady: the point on the compute stream where a layer's KV write was queued.

The engine reports a layer's KV to its sink (cluster/engine/kv_sink.py) when it has
*queued* the layer's cache write; on a GPU the kernels may still be running. The engine
marks that point; the sink acts on the layer (posts its WRITE) once the device has
passed it, polling the mark from its own loop, so the compute stream never waits for
the network and the network never reads unwritten KV.
"""

from __future__ import annotations

import torch


class LayerReady:
    """A mark on the current stream of `device`: `done()` is True once the device has run
    everything queued before it. CPU ops run as they are called: there, done when made."""

    def __init__(self, device: torch.device) -> None:
        self._event: torch.cuda.Event | None = None
        if device.type == "cuda":
            self._event = torch.cuda.Event()
            self._event.record(torch.cuda.current_stream(device))

    def done(self) -> bool:
        """Never blocks: a query of the mark, not a wait on the stream."""
        return self._event is None or self._event.query()
