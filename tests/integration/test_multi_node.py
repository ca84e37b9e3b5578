"""A Ray cluster of three nodes on this machine, started as an operator starts one, with
`ray start`: a head, a prefill node and two decode nodes, each advertising its phase's
resource as deploy/ray-cluster.yaml's node types do. `splitserve serve --address` joins
it and places each pool by node type. A request's KV crosses from the prefill node to a
decode node over UCX, and its tokens equal colocated serving's; a whole decode node lost
mid-stream (its `ray start` session killed: raylet and workers) ends with the stream
finished on the replacement the pool placed on the other decode node, token for token,
nothing lost."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from splitserve.client import Client, Reply
from tests.helpers import wait_until
from tests.integration.conftest import WORKER_ENGINE
from tests.integration.router_harness import RouterHarness, ask, serving

RAY = str(Path(sys.executable).with_name("ray"))
# The engine of the session's shared workers (conftest.WORKER_ENGINE): the colocated
# reference runs on one of them.
CONFIG = f"""
engine: {{dtype: float32, quantization: {WORKER_ENGINE["quantization"]}, kv_cache_gb: 0.2,
         threads: 1, max_num_batched_tokens: 256}}
prefill: {{resources: {{prefill_node: 1}}}}
decode: {{resources: {{decode_node: 1}}}}
transfer: {{local_prefill_tokens: 0}}
router: {{port: 0, http_port: 0, metrics_port: 0, migration_wait_s: 240}}
"""
SHORT = {"max_tokens": 24, "ignore_eos": True}
LONG = {"max_tokens": 160, "ignore_eos": True}


def _prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000, 40000) for _ in range(n)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class Node:
    """One `ray start --block`, in a session of its own: killing the session is the node's
    loss (its raylet and every worker process it started)."""

    def __init__(self, args: list[str], log: Path) -> None:
        self.log = log.open("w")
        self.process = subprocess.Popen(
            [RAY, "start", "--block", "--disable-usage-stats", *args],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        # One node at a time: nodes starting together on two cores time out registering.
        started = lambda: "Ray runtime started" in log.read_text()
        try:
            up = lambda: started() or self.process.poll() is not None
            wait_until(up, f"{log.stem} up", 180)
            assert started(), log.read_text()
        except BaseException:
            self.kill()
            raise

    def members(self) -> dict[int, str]:
        """The processes of this node's session, by pid, with their titles."""
        found = {}
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                    title = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
                except OSError:
                    continue
                if int(stat[3]) == self.process.pid:  # field 6: session
                    found[int(entry.name)] = title
        return found

    def runs(self, name: str) -> bool:
        """Whether a process of this node's session has `name` in its title (an actor)."""
        return any(name in title for title in self.members().values())

    def kill(self) -> None:
        """Every process of the session at once, as a machine goes: Ray's workers have
        process groups of their own, and one outlives its raylet until it notices."""
        for pid in self.members():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.process.wait(30)
        self.log.close()


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[tuple[str, dict[str, Node]]]:
    port = _free_port()
    # Ray's sockets live under its temp dir, and a socket's path has at most 107 bytes.
    temp = tempfile.TemporaryDirectory(prefix="ray-", dir="/tmp")
    nodes: dict[str, Node] = {}
    try:
        nodes["head"] = Node(
            ["--head", f"--port={port}", "--num-cpus=0", "--include-dashboard=false",
             f"--temp-dir={temp.name}"],
            tmp_path / "head.log",
        )  # fmt: skip
        address = f"127.0.0.1:{port}"
        for name, resource in (("prefill", "prefill_node"), ("decode-a", "decode_node"),
                               ("decode-b", "decode_node")):  # fmt: skip
            nodes[name] = Node(
                [
                    f"--address={address}",
                    "--num-cpus=1",
                    f"--resources={json.dumps({resource: 1})}",
                ],
                tmp_path / f"{name}.log",
            )
        yield address, nodes
    finally:
        for node in reversed(nodes.values()):
            node.kill()
        temp.cleanup()


def _series(metrics_url: str, name: str, label: str) -> list[float]:
    """The router's values of series `name` whose labels include `label` (key="value")."""
    scraped = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    pattern = rf"^{re.escape(name)}\{{[^}}]*{re.escape(label)}[^}}]*\}} (\S+)"
    return [float(v) for v in re.findall(pattern, scraped, re.M)]


async def _stream_killing(address: str, prompt: list[int], node: Node) -> tuple[list[int], Any]:
    """The stream's tokens and its last message; `node` killed once 4 tokens are in."""
    ids: list[int] = []
    last = None
    async with Client(address) as client:
        async for piece in client.stream(prompt, timeout_s=300, **LONG):
            ids.extend(piece.token_ids)
            if len(ids) >= 4 and node.process.poll() is None:
                node.kill()
            last = piece
    return ids, last


def test_pools_placed_by_node_type_serve_across_nodes_and_survive_a_lost_decode_node(
    cluster: tuple[str, dict[str, Node]], workers: Any, tmp_path: Path
) -> None:
    short, long = _prompt(1, 40), _prompt(2, 300)
    colocated = RouterHarness({}, {"colocated": workers.decode("colocated")}, None)
    try:
        want = [ask(colocated.address, p, **f).token_ids for p, f in ((short, SHORT), (long, LONG))]
    finally:
        colocated.stop()

    address, nodes = cluster
    config = tmp_path / "serve.yaml"
    config.write_text(CONFIG)
    server = subprocess.Popen(
        [sys.executable, "-m", "splitserve.cli", "serve", "--config", str(config),
         "--address", address],
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )  # fmt: skip
    log: list[str] = []
    try:
        grpc_address = serving(server, log)
        text = "".join(log)
        assert f"ray: joined {address}" in text
        metrics = re.search(r"metrics on (\S+)", text)
        assert metrics is not None
        metrics_url = metrics.group(1)

        # Each pool on its node type: the prefill worker on the prefill node, the decode
        # worker on one of the decode nodes; the KV crosses between their raylets.
        assert nodes["prefill"].runs("PrefillWorker")
        [on] = [n for n in ("decode-a", "decode-b") if nodes[n].runs("DecodeWorker")]
        first: Reply = ask(grpc_address, short, **SHORT)
        assert (first.prefill_worker, first.decode_worker) == ("prefill-0", "decode-0")
        assert first.token_ids == want[0]
        received = _series(metrics_url, "splitserve_kv_transfer_bytes_total", 'worker="decode-0"')
        assert received and received[0] > 0  # over UCX, from the prefill node's worker

        # The decode worker's whole node goes mid-stream: once the stream has tokens the
        # decode worker sampled (the first is the prefill worker's), however fast it runs.
        moved_ids, last = asyncio.run(_stream_killing(grpc_address, long, nodes[on]))
        assert moved_ids == want[1]
        assert last.decode_worker == "decode-1"  # the replacement, on the other node
        other = "decode-b" if on == "decode-a" else "decode-a"
        assert nodes[other].runs("DecodeWorker")
        server.send_signal(signal.SIGTERM)
        assert server.wait(60) == 0, "".join(log)
    finally:
        (tmp_path / "serve.log").write_text("".join(log))  # for a failure's post-mortem
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait(30)
