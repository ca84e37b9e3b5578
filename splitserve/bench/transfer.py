"""`splitserve bench transfer`: splitserve's KV transfer against raw UCX, and how much of
the transfer stays exposed after prefill, with layer-wise streaming on and off.

Three measurements in one run, on one machine, between two processes:
1. Raw UCX: `ucx_perftest` (from the libucx wheel) put bandwidth with the transports
   splitserve's endpoint uses on one host (cma zero-copy, tcp on lo), one message the
   size of a prompt's KV, and one message the size of one WRITE descriptor.
2. splitserve: the KV of 512-, 2048- and 8192-token prompts (the bundled model's layout,
   all layers, K and V) written by KVEndpoint into another process's pages; bytes over
   the time from posting to the receiver reading the last notice. Again into a receiver
   whose model is split over two ranks (its 3 KV heads 2 + 1, a NIXL agent each): pages
   are head-major, so each rank's heads of each page are one run (one descriptor a page,
   where the equal split merges a run of pages into one).
3. Exposure: real prefills on the bundled model pushing into a receiver. Exposed
   transfer = time until the receiver holds all KV (DONE plus every WRITE notice)
   minus the same prefill's time with no transfer at all (medians, interleaved runs).
   Also per prefill: the time spent inside WRITE posts (on one host UCX copies with cma
   while posting, on the prefill's thread) and the tail after the first token.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import statistics
import subprocess
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from cluster.config import EngineConfig
from cluster.engine.engine import LLMEngine
from cluster.engine.kernels.kv_cache import KVCache, KVLayout
from cluster.engine.model.checkpoint import load_checkpoint
from cluster.engine.model.model_files import bundled_model_path
from cluster.engine.model.tensor_parallel import split
from cluster.transfer.endpoint import KVEndpoint
from cluster.transfer.wire import Handshake, Notice, NoticeKind, compat_hash
from cluster.types import KVTarget, PageId, RequestId, SamplingParams
from prefill_worker.sender import KVSender
from splitserve.bench import RESULTS

TOKENS = (512, 2048, 8192)
PAGE_SIZE = 16
UCX_TLS = "self,cma,tcp"


@dataclass(frozen=True)
class Bandwidth:
    tokens: int
    bytes: int
    descriptor_bytes: int
    splitserve_gbps: float
    perftest_whole_gbps: float  # one message of the prompt's KV size
    perftest_descriptor_gbps: float  # messages of one descriptor's size (cache-warm)
    # the same KV into a receiver whose model is split over two ranks (tensor parallelism):
    # each rank's heads of each page, a run each
    split_gbps: float

    @property
    def ratio(self) -> float:
        return self.splitserve_gbps / self.perftest_whole_gbps

    @property
    def split_share(self) -> float:
        """Into the split receiver against into one rank, in the same run."""
        return self.split_gbps / self.splitserve_gbps


@dataclass(frozen=True)
class Exposure:
    tokens: int
    stream_layers: bool
    prefill_s: float  # the same prefill with no transfer
    kv_complete_s: float  # prefill start to the receiver holding all KV
    writes: int
    post_s: float  # time inside WRITE posts per prefill (cma copies while posting)
    tail_s: float  # from the first token to the receiver holding all KV

    @property
    def exposed_s(self) -> float:
        return max(0.0, self.kv_complete_s - self.prefill_s)

    @property
    def exposed_share(self) -> float:
        return self.exposed_s / self.prefill_s


# --- raw UCX ---------------------------------------------------------------------------------


def ucx_perftest_gbps(size: int, iters: int) -> float:
    """Put bandwidth between two ucx_perftest processes on this host, GB/s."""
    import libucx

    root = Path(libucx.__file__).parent
    exe = root / "bin" / "ucx_perftest"
    env = {**os.environ, "UCX_TLS": UCX_TLS, "LD_LIBRARY_PATH": str(root / "lib")}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen(
        [exe, "-p", str(port)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        for _ in range(50):  # the server needs a moment to listen
            time.sleep(0.1)
            run = subprocess.run(
                [exe, "127.0.0.1", "-p", str(port), "-t", "ucp_put_bw", "-s", str(size),
                 "-n", str(iters)],
                env=env, capture_output=True, text=True, timeout=120,
            )  # fmt: skip
            final = [ln for ln in run.stdout.splitlines() if ln.startswith("Final:")]
            if final:
                return float(final[0].split()[5]) * 1e6 / 1e9  # "overall" MB/s column
        raise RuntimeError(f"ucx_perftest gave no result: {run.stderr[-500:]}")
    finally:
        server.kill()
        server.wait()


# --- the receiving process -----------------------------------------------------------------


def _receiver(
    conn: Any,
    layout: KVLayout,
    num_pages: int,
    compat: bytes,
    poll_s: float,
    device: str,
    splits: tuple[range, ...],
    name: str,
) -> None:
    """Holds a KV cache (a rank's per split of the heads, each its own agent) and polls
    notices every poll_s, rounds or not (so a prefill measured alone shares the CPU with
    the same polling); reports when a round's KV has all landed."""
    torch.set_num_threads(1)
    ranks = []
    for r, heads in enumerate(splits or (range(layout.num_kv_heads),)):
        cache = KVCache(replace(layout, num_kv_heads=len(heads)), num_pages, torch.device(device))
        agent = name if r == 0 else f"{name}-rank{r}"
        ranks.append(KVEndpoint(agent, cache, compat, "lo", heads=heads))
    ep = ranks[0]
    conn.send(Handshake(compat, layout.num_layers, tuple(e.memory() for e in ranks)).encode())
    in_round, landed, expected = False, 0, None
    while True:
        for rank in ranks[1:]:  # as a worker's other ranks do (TensorRank.progress_kv)
            rank.progress()
        for n in ep.notices():
            if n.kind is NoticeKind.STARTED:  # a KVSender's claim: answer as a decode worker
                ep.notify(ep.connect(n.handshake), Notice(NoticeKind.ACK, n.request_id))
            elif n.kind is NoticeKind.LAYERS:
                landed += 1
            elif n.kind is NoticeKind.DONE:
                expected = n.num_writes
        if in_round and expected is not None and landed >= expected:
            conn.send(time.monotonic())
            in_round = False
        if conn.poll():
            if conn.recv() != "round":
                return
            in_round, landed, expected = True, 0, None
        time.sleep(poll_s)


class Receiver:
    def __init__(
        self,
        layout: KVLayout,
        num_pages: int,
        compat: bytes,
        poll_s: float,
        device: str = "cpu",
        splits: tuple[range, ...] = (),  # the receiver's model split over ranks: their heads
        name: str = "bench-receiver",
    ) -> None:
        ctx = mp.get_context("spawn")
        self.conn, there = ctx.Pipe()
        args = (there, layout, num_pages, compat, poll_s, device, splits, name)
        self.proc = ctx.Process(target=_receiver, args=args)
        self.proc.start()
        self.handshake: bytes = self.conn.recv()

    def start_round(self) -> None:
        self.conn.send("round")

    def landed_at(self, progress: Any) -> float:
        """When the receiver had it all; `progress()` drives the sender's UCX meanwhile."""
        while not self.conn.poll(0.0002):
            progress()
        return float(self.conn.recv())

    def close(self) -> None:
        self.conn.send("stop")
        self.proc.join(10)


# --- measurements ----------------------------------------------------------------------------


def kv_bandwidth(
    layout: KVLayout,
    compat: bytes,
    reps: int,
    tokens_list: tuple[int, ...] = TOKENS,
    device: str = "cpu",  # both caches: "cuda" is GPU to GPU on one device
    receivers: tuple[tuple[range, ...], ...] = ((),),  # each one's ranks: their heads
) -> list[list[tuple[int, int, int, float]]]:
    """For each receiver (its model split over ranks by their KV heads; () is one rank),
    (tokens, bytes, descriptor bytes, GB/s) for each prompt size, all layers in one WRITE.
    The receivers' rounds alternate rep by rep, so a load that drifts over the run weighs
    on each alike."""
    pages = max(tokens_list) // PAGE_SIZE
    cache = KVCache(layout, pages, torch.device(device))
    cache.k.normal_()
    cache.v.normal_()
    ep = KVEndpoint("bench-sender", cache, compat, "lo")
    there = [
        Receiver(layout, pages, compat, 0.0002, device, splits, f"bench-receiver{i}")
        for i, splits in enumerate(receivers)
    ]
    peers = [ep.connect(r.handshake) for r in there]  # descriptors prepared here
    out: list[list[tuple[int, int, int, float]]] = [[] for _ in there]
    try:
        for tokens in tokens_list:
            ids = [PageId(p) for p in range(tokens // PAGE_SIZE)]
            rates: list[list[float]] = [[] for _ in there]
            nbytes = 0
            for _ in range(reps + 1):  # the first round warms up: not counted
                for receiver, peer, got in zip(there, peers, rates, strict=True):
                    receiver.start_round()
                    notice = Notice(NoticeKind.LAYERS, RequestId("bw"), 0, layout.num_layers)
                    started = time.monotonic()
                    write = ep.write(peer, range(layout.num_layers), ids, ids, notice)
                    while not ep.finished(write):
                        pass
                    ep.notify(peer, Notice(NoticeKind.DONE, RequestId("bw"), num_writes=1))
                    landed = receiver.landed_at(ep.notices)
                    got.append(write.num_bytes / (landed - started) / 1e9)
                    nbytes = write.num_bytes
            for mine, got in zip(out, rates, strict=True):
                desc = len(ids) * ep.page_bytes
                mine.append((tokens, nbytes, desc, statistics.median(got[1:])))
    finally:
        for receiver in there:
            receiver.close()
    return out


def exposure(
    engine: LLMEngine, compat: bytes, reps: int, tokens_list: tuple[int, ...]
) -> list[Exposure]:
    """Prefills alone and pushing with streaming on and off, interleaved rep by rep."""
    layout = engine.layout
    # Polling like a decode worker with a transfer in flight (its tick is 1 ms).
    receiver = Receiver(layout, max(tokens_list) // PAGE_SIZE + 1, compat, poll_s=0.001)
    ep = KVEndpoint("bench-prefill", engine.cache, compat, "lo")
    senders = {
        s: KVSender(ep, engine.holds, layout.page_size, layout.num_layers, s) for s in (True, False)
    }
    out = []
    try:
        for tokens in tokens_list:
            ids = [(7 * i + 11) % 40000 + 100 for i in range(tokens)]
            pages = tuple(PageId(p) for p in range(-(-tokens // PAGE_SIZE)))
            alone: list[float] = []
            pushed: dict[bool, list[float]] = {True: [], False: []}
            tails: dict[bool, list[float]] = {True: [], False: []}
            writes = {s: senders[s].stats.writes for s in senders}
            posts = {s: senders[s].stats.post_s for s in senders}
            for _ in range(reps + 1):  # the first round also connects: not counted
                alone.append(_prefill(engine, ids, None)[0])
                for stream, sender in senders.items():
                    receiver.start_round()
                    sender.start(RequestId("x"), KVTarget(receiver.handshake, pages, 0, 600.0))
                    took, started = _prefill(engine, ids, sender)
                    landed = receiver.landed_at(sender.poll)
                    pushed[stream].append(landed - started)
                    tails[stream].append(landed - started - took)
                    while sender.poll():
                        pass
            base = statistics.median(alone[1:])
            for stream, sender in senders.items():
                rounds = reps + 1
                out.append(
                    Exposure(
                        tokens,
                        stream,
                        base,
                        statistics.median(pushed[stream][1:]),
                        (sender.stats.writes - writes[stream]) // rounds,
                        (sender.stats.post_s - posts[stream]) / rounds,
                        statistics.median(tails[stream][1:]),
                    )
                )
    finally:
        receiver.close()
    return out


def _prefill(engine: LLMEngine, ids: list[int], sender: KVSender | None) -> tuple[float, float]:
    """(seconds, start time) of one prefill, pushing through `sender` when given."""
    rid = RequestId("x")
    started = time.monotonic()
    engine.add_request(ids, SamplingParams(max_tokens=1), rid)
    while engine.has_unfinished():
        engine.step(sender)
    return time.monotonic() - started, started


# --- report ----------------------------------------------------------------------------------


def report(bandwidth: list[Bandwidth], exposures: list[Exposure]) -> str:
    lines = [
        f"KV transfer bandwidth between two processes (UCX_TLS={UCX_TLS} for ucx_perftest)",
        f"{'prompt':>8} {'KV bytes':>10} {'splitserve':>11} {'perftest':>9} {'ratio':>6}"
        f" {'perftest@desc':>14} {'into TP=2':>10} {'share':>6}",
    ]
    for b in bandwidth:
        lines.append(
            f"{b.tokens:>8} {b.bytes / 2**20:>8.1f}Mi {b.splitserve_gbps:>7.2f}GB/s "
            f"{b.perftest_whole_gbps:>5.2f}GB/s {b.ratio:>5.0%} "
            f"{b.perftest_descriptor_gbps:>6.2f}GB/s@{b.descriptor_bytes // 1024}Ki "
            f"{b.split_gbps:>6.2f}GB/s {b.split_share:>5.0%}"
        )
    lines += [
        "",
        "Exposed transfer: KV complete on the receiver minus the prefill alone (bundled model)",
        f"{'prompt':>8} {'streaming':>9} {'prefill':>8} {'KV done':>8} {'exposed':>8} {'share':>6}"
        f" {'WRITEs':>6} {'in posts':>8} {'tail':>7}",
    ]
    for e in exposures:
        lines.append(
            f"{e.tokens:>8} {'on' if e.stream_layers else 'off':>9} {e.prefill_s:>7.3f}s "
            f"{e.kv_complete_s:>7.3f}s {e.exposed_s * 1e3:>6.1f}ms {e.exposed_share:>6.1%} "
            f"{e.writes:>6} {e.post_s * 1e3:>6.1f}ms {e.tail_s * 1e3:>5.1f}ms"
        )
    two_k = next(b for b in bandwidth if b.tokens == 2048)
    split = min(b.split_share for b in bandwidth)
    lines += [
        "",
        f"target: 2048-token KV at >= 80% of raw UCX: {two_k.ratio:.0%} "
        f"({'met' if two_k.ratio >= 0.8 else 'MISSED'})",
        f"target: KV into the 2 + 1 split at >= 50% of into one rank: worst {split:.0%} "
        f"({'met' if split >= 0.5 else 'MISSED'})",
    ]
    streamed = [e for e in exposures if e.stream_layers]
    if streamed:
        worst = max(e.exposed_share for e in streamed)
        lines.append(
            f"target: exposed transfer <= 10% of prefill with streaming: worst {worst:.1%} "
            f"({'met' if worst <= 0.10 else 'MISSED'})"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="splitserve bench transfer", description=__doc__)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument(
        "--exposure-tokens",
        type=int,
        nargs="*",
        default=[512, 2048],
        help="prompt sizes of the exposure measurement; none: bandwidth only",
    )
    parser.add_argument("--threads", type=int, default=None, help="torch threads for prefill")
    parser.add_argument("--out", type=Path, default=RESULTS / "transfer.json")
    args = parser.parse_args(argv)

    spec, _ = load_checkpoint(bundled_model_path())
    compat = compat_hash(spec, "float32", "auto", PAGE_SIZE, "none")
    layout = KVLayout.of(spec, PAGE_SIZE, torch.float32)
    heads = tuple(range(a, b) for a, b in split(spec.num_kv_heads, 2, 1))
    measured, into_split = kv_bandwidth(layout, compat, args.reps, receivers=((), heads))
    bandwidth = [
        Bandwidth(
            tokens,
            nbytes,
            desc,
            gbps,
            ucx_perftest_gbps(nbytes, max(4, 2**30 // nbytes)),
            ucx_perftest_gbps(desc, 200),
            split_gbps,
        )
        for (tokens, nbytes, desc, gbps), (*_, split_gbps) in zip(measured, into_split, strict=True)
    ]
    exposures = []
    if args.exposure_tokens:
        engine = LLMEngine(
            EngineConfig(
                kv_cache_gb=0.5, prefix_caching=False, page_size=PAGE_SIZE, threads=args.threads
            )
        )
        exposures = exposure(engine, compat, args.reps, tuple(args.exposure_tokens))
    print(report(bandwidth, exposures))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "bandwidth": [
                    {**asdict(b), "ratio": b.ratio, "split_share": b.split_share} for b in bandwidth
                ],
                "exposure": [
                    {**asdict(e), "exposed_s": e.exposed_s, "exposed_share": e.exposed_share}
                    for e in exposures
                ],
            },
            indent=2,
        )
    )
    print(f"\nresults: {args.out}")
    return 0
