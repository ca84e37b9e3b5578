"""`splitserve serve` as users run it: a child process with its own Ray and Redis, the
`generate --server` and `chat` commands against it, and a clean stop on SIGTERM."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path

from splitserve.client import Client
from splitserve_api.v1 import splitserve_pb2 as pb
from tests.helpers import wait_until
from tests.integration.router_harness import serving

CONFIG = """
engine: {kv_cache_gb: 0.2, threads: 1, max_num_batched_tokens: 256}
prefill: {resources: {prefill_node: 1}}  # the local Ray plays both node types
decode: {resources: {decode_node: 1}}
router: {port: 0, grace_s: 30, metrics_port: 0, http_port: 0}
"""
SPLITSERVE = [sys.executable, "-m", "splitserve.cli"]


def _descendants(pid: int) -> set[int]:
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = set(), {pid}
    while frontier:
        frontier = {p for p, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"


def test_serve_answers_cli_clients_and_stops_cleanly(tmp_path: Path) -> None:
    config = tmp_path / "serve.yaml"
    config.write_text(CONFIG)
    server = subprocess.Popen(
        [*SPLITSERVE, "serve", "--config", str(config), "--served-model-name", "smol"],
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "SPLITSERVE_MAX_MODEL_LEN": "1024"},
    )
    log: list[str] = []
    address = serving(server, log, 180)
    text = "\n".join(log)
    for component in (
        "redis: embedded valkey-server at redis://127.0.0.1:",
        "ray: local",
        "prefill-0: starting, loading the bundled model",
        "prefill-0: ready in",
        "decode-0: ready in",
        "sequences of the max length",
        "router: gRPC on 127.0.0.1:",
        "router: Prometheus metrics on http://127.0.0.1:",
        "; started in ",
    ):
        assert component in text, component
    found = re.search(r"metrics on (\S+)", text)
    assert found is not None
    metrics_url = found.group(1)
    http = re.search(r"HTTP API on (\S+)/v1", text)
    assert http is not None, text
    children = _descendants(server.pid)
    try:
        models = json.load(urllib.request.urlopen(f"{http.group(1)}/v1/models", timeout=10))
        [card] = models["data"]  # the flag's name and the variable's context
        assert (card["id"], card["max_model_len"]) == ("smol", 1024), card
        gen = subprocess.run(
            [
                *SPLITSERVE,
                "generate",
                "--server",
                address,
                "--chat",
                "What is 2+2?",
                "--max-tokens",
                "12",
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert gen.returncode == 0, gen.stderr
        assert gen.stdout.strip(), gen.stderr
        scraped = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
        assert 'splitserve_requests_total{status="ok"} 1.0' in scraped
        chat = subprocess.run(
            [*SPLITSERVE, "chat", "--server", address, "--max-tokens", "8"],
            input="Hello, who are you?\nSay that again.\n",
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert chat.returncode == 0, chat.stderr
        assert len([line for line in chat.stdout.splitlines() if line.strip()]) >= 2, chat.stdout

        # SIGTERM mid-stream: the request in flight still finishes, within the grace period.
        # It is signalled once this client holds two tokens, so the decode worker has it
        # (the router's /metrics shows the stats it last polled: they can still count the
        # chat's last request as running, and SIGTERM then came before this one connected).
        pieces: list[pb.GenerateResponse] = []
        streaming = threading.Thread(
            target=stream, args=(address, "Tell me about the moon.", pieces), daemon=True
        )
        streaming.start()
        wait_until(lambda: sum(len(p.token_ids) for p in pieces) >= 2, "two tokens", 60)
        server.send_signal(signal.SIGTERM)
        streaming.join(60)
        assert sum(len(p.token_ids) for p in pieces) == 48
        assert pieces[-1].usage.completion_tokens == 48
        assert server.wait(60) == 0, "".join(log)
    finally:
        if server.poll() is None:
            server.kill()
    left = lambda: [p for p in children if _alive(p)]
    wait_until(lambda: not left(), "every child to exit after splitserve serve did", 15)
    assert "splitserve: stopped" in "".join(log)


def stream(address: str, prompt: str, pieces: list[pb.GenerateResponse]) -> None:
    """48 tokens of `prompt` over gRPC, each piece appended to `pieces` as it comes."""

    async def run() -> None:
        async with Client(address) as client:
            async for piece in client.stream(prompt, 120, max_tokens=48, ignore_eos=True):
                pieces.append(piece)

    asyncio.run(run())


# The start-up without its port check, as when another process takes the HTTP port
# between the check and the bind: the router fails after Redis, Ray and the workers started.
FAIL_AFTER_START = """
import sys

import splitserve.launch
from splitserve.cli import main

splitserve.launch.check_ports = lambda config: None
sys.exit(main(["serve", "--config", sys.argv[1]]))
"""


def test_a_start_that_fails_after_redis_and_ray_leaves_no_process_behind(tmp_path: Path) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        config = tmp_path / "serve.yaml"
        config.write_text(CONFIG.replace("http_port: 0", f"http_port: {port}"))
        server = subprocess.Popen(
            [sys.executable, "-c", FAIL_AFTER_START, str(config)],
            stderr=subprocess.PIPE,
            text=True,
        )
        assert server.stderr is not None
        log: list[str] = []
        children: set[int] = set()
        for line in server.stderr:  # what it started, seen while it runs
            log.append(line)
            if "ray: local" in line or "redis: embedded" in line:
                children |= _descendants(server.pid)
        assert server.wait(60) != 0
    text = "".join(log)
    assert f"{port}): address already in use" in text, text
    assert "redis: embedded" in text and "ray: local" in text, text
    assert text.count("Started a local Ray instance") == 1, text  # none while tearing down
    assert "was never awaited" not in text, text
    left = lambda: [p for p in children if _alive(p)]
    wait_until(lambda: not left(), "every child to exit after the failed start", 15)
