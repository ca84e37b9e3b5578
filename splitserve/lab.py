"""`splitserve lab`: a web page of the capacity plan, and of the cluster when one serves.

- The capacity explorer: model, hardware, weight bits, KV cache GiB, context, KV dtype
  and tensor parallel size (figures then per device) as controls; pages, tokens, the
  sequences that fit, the decode floor (tokens/s at the memory wall, all-reduces
  included) and whether weights and KV fit the device, each computed on the server by
  `splitserve plan capacity`'s own functions (splitserve/capacity.py) at GET
  /lab/capacity, so the page shows what the CLI prints for the same inputs.
- The live view, on a router's HTTP API (`splitserve serve` adds these routes there):
  each worker's KV pages in use, running and waiting requests, prefill queue and KV
  transfers, the requests in flight and the workers each is on, migrations; the page
  reads router/lab.py's GET /lab/live (with the API key when the router has one) twice a
  second.

- Measured points: `splitserve lab --plan-only --kv-capacity FILE` adds a table of what
  `splitserve bench kv-capacity` measured (its JSON): per KV cache size and dtype, the
  sequences plan capacity predicts beside the peak the engine ran, and goodput.

One HTML file (splitserve/lab.html) with its script and style inline: no build step, no
CDN; it ships in the wheel. `splitserve lab --plan-only` serves the capacity explorer
alone, on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Mapping
from importlib.resources import files
from pathlib import Path
from typing import Any

from aiohttp import web

from cluster.config import ConfigError
from splitserve.capacity import ARCHITECTURES, KV_DTYPES, decode_bound, kv_capacity, weight_bytes
from splitserve.hardware import GPUS

WEIGHT_BITS = (16, 8, 4)
TENSOR_PARALLEL = (1, 2, 4, 8)
TP_LINK_GB_S = 300.0  # plan capacity's --tp-link-gb-s default (NVLink 3)


def capacity(q: Mapping[str, str]) -> dict[str, Any]:
    """The plan for one set of inputs (query fields as the page sends them); ConfigError
    naming the field for a value out of range."""

    def number(field: str, kind: type[int] | type[float], low: float) -> Any:
        try:
            value = kind(q[field])
        except (KeyError, ValueError):
            raise ConfigError(f"{field}: a number is needed, got {q.get(field)!r}") from None
        if not math.isfinite(value) or value < low:
            raise ConfigError(f"{field}: a finite number, at least {low:g}, got {value:g}")
        return value

    def choice(field: str, options: Any, default: str | None = None) -> Any:
        name = q.get(field, default)
        if name not in options:
            raise ConfigError(f"{field}: one of {list(options)}, got {name!r}")
        return name

    spec = ARCHITECTURES[choice("model", ARCHITECTURES)]
    hw = GPUS[choice("hardware", GPUS)]
    bits = number("weight_bits", float, 1)
    kv_gb = number("kv_cache_gb", float, 0)
    context = number("context", int, 1)
    kv_dtype = choice("kv_dtype", KV_DTYPES, "bfloat16")
    page_size = number("page_size", int, 1) if "page_size" in q else 16
    tp = number("tensor_parallel", int, 1) if "tensor_parallel" in q else 1
    cap = kv_capacity(spec, kv_dtype, page_size, kv_gb, tp)  # KV GiB and pages per device
    sequences = cap.sequences(context)
    one = decode_bound(spec, hw, bits, kv_dtype, 1, context, tp, TP_LINK_GB_S)
    full = decode_bound(spec, hw, bits, kv_dtype, max(1, sequences), context, tp, TP_LINK_GB_S)
    weights_gb = weight_bytes(spec, bits, tp) / 1e9
    need_gb = weights_gb + kv_gb * 2**30 / 1e9
    return {
        "pages": cap.pages,
        "tokens": cap.tokens,
        "sequences": sequences,
        "kv_kib_per_token": cap.bytes_per_token / 1024,
        "weights_gb": weights_gb,
        "memory_gb": hw.memory_gb,
        "fits": need_gb <= hw.memory_gb,
        "need_gb": need_gb,
        "tok_s_per_user": one.tokens_per_s_per_user,
        "batch": full.batch,
        "tok_s_at_batch": full.tokens_per_s,
        "bound_at_batch": full.bound,
        "allreduce_ms_at_batch": full.allreduce_s * 1e3,
    }


MEASURED = ("kv_gb", "kv_dtype", "pages", "predicted_seqs", "predicted_held", "peak_seqs",
            "held_seqs", "goodput")  # fmt: skip


def measured(path: Path) -> dict[str, Any]:
    """The rows of a `bench kv-capacity` result the page shows; ConfigError naming the
    flag for a file that is not one."""
    try:
        result = json.loads(path.read_text())
        rows = [{k: row[k] for k in MEASURED} for row in result["rows"]]
        return {"host": str(result["host"]), "rows": rows}
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(
            f"--kv-capacity: {path} is not a `splitserve bench kv-capacity` result ({e!r})"
        ) from None


def page(points: dict[str, Any] | None = None) -> str:
    options = {
        "models": list(ARCHITECTURES),
        "hardware": list(GPUS),
        "weight_bits": list(WEIGHT_BITS),
        "kv_dtypes": list(KV_DTYPES),
        "tensor_parallel": list(TENSOR_PARALLEL),
    }
    html = files("splitserve").joinpath("lab.html").read_text()
    html = html.replace("__MEASURED__", json.dumps(points))
    return html.replace("__OPTIONS__", json.dumps(options))


async def _capacity(request: web.Request) -> web.Response:
    try:
        return web.json_response(capacity(request.query))
    except ConfigError as e:
        return web.json_response({"error": str(e)}, status=400)


def routes(points: dict[str, Any] | None = None) -> list[web.RouteDef]:
    """The page (with measured `points`, if any) and its capacity arithmetic (a router adds
    its own GET /lab/live)."""
    text = page(points)

    async def _page(request: web.Request) -> web.Response:
        return web.Response(text=text, content_type="text/html")

    return [web.get("/lab", _page), web.get("/lab/capacity", _capacity)]


async def serve(port: int, points: dict[str, Any] | None = None) -> None:
    """The capacity explorer alone on 127.0.0.1:port (0: any free one), until cancelled."""
    app = web.Application()
    app.router.add_routes(routes(points))
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", port)
        await site.start()
        host, bound = runner.addresses[0][:2]
        print(f"splitserve lab: http://{host}:{bound}/lab; Ctrl-C to stop", flush=True)
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()
