"""`splitserve bench chaos` in its smallest form: a real `splitserve serve` with one prefill
and one decode worker, 4 streams of short requests, one kill -9 of the prefill worker.
A dead prefill worker loses nothing (its decode workers recompute), so every request
completes with the idle run's tokens, the pool replaces the worker and no page is held.
Then the pressure scenarios in small: 4 streams and 8 + 8 refusals on each front door;
a 2-second flood of near-limit texts beside a normal client; a burst of 8 from two
pre-connected clients while 4 streams run, on each front door."""

from __future__ import annotations

import json
from pathlib import Path

from splitserve.bench.chaos import main

TINY = [
    "--prefill", "1", "--decode", "1", "--kv-cache-gb", "0.1",
    "--mix", "6", "--prompt-median", "40", "--prompt-max", "80",
    "--output-min", "8", "--output-median", "12", "--output-max", "16",
    "--concurrency", "4", "--interval-s", "1",
]  # fmt: skip


def test_one_prefill_kill_loses_no_request_and_leaks_no_page(tmp_path: Path) -> None:
    out = tmp_path / "chaos.json"
    argv = [*TINY, "--kills", "1", "--kill-phase", "prefill", "--no-redis-kill"]
    assert main([*argv, "--json", str(out), "--log-dir", str(tmp_path)]) == 0
    result = json.loads(out.read_text())
    s = result["summary"]
    assert s["sent"] == s["completed"] + s["failed"] == len(result["requests"])
    assert s["sent"] >= 6  # every request of the mix at least once
    assert (s["failed"], s["wrong_tokens"], s["failed_after_wrong_tokens"]) == (0, 0, 0)
    [fault] = result["faults"]
    assert (fault["target"], fault["gone"], fault["replacement"]) == (
        "prefill",
        "prefill-0",
        "prefill-1",
    )
    assert fault["recovered_s"] > 0
    assert s["pages_all_free"] is True
    assert {p["worker"] for p in s["pages"]} == {"decode-0", "prefill-1"}


PRESSURE = ["--max-pending", "4", "--distinct", "1", "--prompt-tokens", "8", "--kv-cache-gb", "0.2"]


def test_overload_refuses_every_request_past_max_pending_on_both_doors_and_streams_right(
    tmp_path: Path,
) -> None:
    out = tmp_path / "overload.json"
    argv = ["--scenario", "overload", *PRESSURE, "--stream-tokens", "128"]
    assert main([*argv, "--json", str(out), "--log-dir", str(tmp_path)]) == 0
    grpc_run, http_run = json.loads(out.read_text())["overload"]
    for run, refused in ((grpc_run, "RESOURCE_EXHAUSTED"), (http_run, "HTTP_429")):
        assert (run["streams"], run["streams_ok"], run["streams_wrong_output"]) == (4, 4, 0)
        for mode in ("at_once", "one_by_one"):
            assert run["burst"][mode]["by_status"] == {refused: 8}, (run["door"], mode)


def test_a_flood_is_refused_and_the_normal_client_is_served(tmp_path: Path) -> None:
    out = tmp_path / "flood.json"
    argv = ["--scenario", "flood", *PRESSURE, "--max-pending-per-client", "2"]
    argv += ["--flood-senders", "4", "--flood-s", "2", "--normal", "2", "--normal-tokens", "4"]
    assert main([*argv, "--json", str(out), "--log-dir", str(tmp_path)]) == 0
    flood = json.loads(out.read_text())["flood"]
    assert set(flood["flood_by_status"]) <= {"INVALID_ARGUMENT", "RESOURCE_EXHAUSTED"}
    assert flood["flood_by_status"]["INVALID_ARGUMENT"] >= 1
    assert flood["normal_failed"] == 0 and flood["normal_during_ms"] is not None


def test_a_burst_is_refused_on_both_doors_while_every_stream_runs_to_its_end(
    tmp_path: Path,
) -> None:
    out = tmp_path / "burst.json"
    argv = ["--scenario", "burst", *PRESSURE, "--stream-tokens", "256", "--burst-clients", "2"]
    argv += ["--setup-s", "2", "--before-s", "0.5"]
    assert main([*argv, "--json", str(out), "--log-dir", str(tmp_path)]) == 0
    grpc_run, http_run = json.loads(out.read_text())["burst"]
    grpc_limit = "RESOURCE_EXHAUSTED: Concurrent RPC limit exceeded!"
    for run, named in (
        (grpc_run, "RESOURCE_EXHAUSTED: max_pending"),
        (http_run, "HTTP_429: max_pending"),
    ):
        assert (run["streams"], run["streams_ok"], run["streams_wrong_output"]) == (4, 4, 0)
        b = run["burst"]
        assert b["streams_through_burst"] == 4  # every stream ran across the whole burst
        assert (b["sent"], b["refusal_ms"]["n"], sum(b["by_status"].values())) == (8, 8, 8)
        assert set(b["by_status"]) <= {named, grpc_limit}, b["by_status"]
        assert b["itl_before_ms"]["n"] >= 1 and b["itl_during_ms"]["n"] >= 1
        assert b["router_cpu_us_per_refusal_raw"] >= b["router_cpu_us_per_refusal"] >= 0
