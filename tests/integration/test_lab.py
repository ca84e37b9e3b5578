"""`splitserve lab` in a real headless Chromium: the capacity explorer shows what
`splitserve plan capacity` prints for the same inputs, before and after a slider moves;
a serving router's page shows its workers and a request in flight on them, which leaves
the view when its client goes; the live view asks for the router's API key."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest

from splitserve import lab
from tests.browser import Browser, Page, chromium
from tests.integration.router_harness import RouterHarness

CLI = [sys.executable, "-m", "splitserve.cli"]
SEQUENCES = "document.getElementById('sequences').textContent"


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Browser]:
    executable = chromium()
    if executable is None:
        pytest.skip("needs Debian's chromium package (scripts/setup installs it with apt)")
    b = Browser(executable, tmp_path_factory.mktemp("chromium"))
    yield b
    b.close()


def _printed(kv_cache_gb: int) -> dict[int, int]:
    """Sequences that fit per context, as `splitserve plan capacity` prints them."""
    out = subprocess.run(
        [*CLI, "plan", "capacity", "--model", "llama-3-8b", "--hardware", "H100"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    header = re.search(r"^ +KV GiB(.*)$", out, re.M)
    row = re.search(rf"^ +{kv_cache_gb}((?: +\d+)+)$", out, re.M)
    assert header is not None and row is not None, out
    return dict(zip(map(int, header.group(1).split()), map(int, row.group(1).split()), strict=True))


MEASURED_ROW = {
    "kv_gb": 0.02, "kv_dtype": "int8", "pages": 114, "predicted_seqs": 3, "predicted_held": 4,
    "peak_seqs": 6, "held_seqs": 4.25, "goodput": 1.5, "runs": [],
}  # fmt: skip
MEASURED_CELLS = "[...document.querySelectorAll('#measured td')].map(td => td.textContent)"


def test_the_capacity_explorer_shows_what_plan_capacity_prints(
    browser: Browser, tmp_path: Any
) -> None:
    """... and the points of a `bench kv-capacity` result given with --kv-capacity."""
    result = tmp_path / "kv-capacity.json"
    result.write_text(json.dumps({"host": "host: this one", "rows": [MEASURED_ROW]}))
    lab_cli = [*CLI, "lab", "--plan-only", "--port", "0", "--kv-capacity", str(result)]
    server = subprocess.Popen(lab_cli, stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None
        found = re.search(r"(http://\S+/lab)", server.stdout.readline())
        assert found is not None

        async def scenario() -> tuple[str, str, bool, Any]:
            async with Page(browser.page()) as page:
                await page.goto(found.group(1))  # llama-3-8b, H100, 16 bits, 40 GiB, 2048
                before = await page.wait_for(SEQUENCES, "the first plan")
                await page.eval(
                    "(() => { const s = document.getElementById('kv_cache_gb');"
                    " s.value = 20; s.dispatchEvent(new Event('input')); })()"
                )
                after = await page.wait_for(
                    f"{SEQUENCES} !== {json.dumps(before)} && {SEQUENCES}", "the plan for 20 GiB"
                )
                hidden = await page.eval("document.getElementById('live').hidden")
                return before, after, hidden, await page.eval(MEASURED_CELLS)

        before, after, hidden, cells = asyncio.run(scenario())
    finally:
        server.terminate()
        server.wait(30)
    assert int(before) == _printed(40)[2048] == 160
    assert int(after) == _printed(20)[2048] == 80
    assert hidden  # `splitserve lab --plan-only` has no cluster to show
    assert cells == ["0.02", "int8", "114", "3 / 4", "6", "4.3", "1.5"]
    live = subprocess.run([*CLI, "lab"], capture_output=True, text=True)
    assert live.returncode == 2 and "/lab" in live.stderr and "--plan-only" in live.stderr
    result.write_text(json.dumps({"rows": [{"kv_gb": 1}]}))
    bad = subprocess.run([*lab_cli, "--port", "0"], capture_output=True, text=True)
    assert bad.returncode == 2 and "--kv-capacity: " in bad.stderr, bad.stderr


def test_the_live_view_shows_the_workers_and_a_request_in_flight_until_it_goes(
    browser: Browser, workers: Any
) -> None:
    prefill, decode, _ = workers.trio()
    harness = RouterHarness(  # every prompt prefilled on the prefill worker
        {"prefill": prefill}, {"decode": decode}, None, 0, lab.routes(), http_port=0
    )
    assert harness.app.http is not None
    base = harness.app.http.address
    rows = (
        "[...document.querySelectorAll('#{} tbody tr')]"
        ".map(r => [...r.cells].map(c => c.textContent))"
    )

    async def scenario() -> tuple[Any, Any]:
        async with aiohttp.ClientSession() as client, Page(browser.page()) as page:
            body = {"prompt": "Tell me about the sea.", "max_tokens": 2000, "ignore_eos": True,
                    "stream": True, "temperature": 0}  # fmt: skip
            async with client.post(f"{base}/v1/completions", json=body) as reply:
                assert reply.status == 200
                await reply.content.readline()  # a first token: it is decoding
                await page.goto(f"{base}/lab")
                seen = await page.wait_for(
                    f"(() => {{ const r = {rows.format('requests')};"
                    " return r.length && r[0][1] === 'decoding' ? r : null; })()",
                    "the request decoding in the live view",
                )
                names = await page.eval(f"{rows.format('workers')}.map(r => [r[0], r[1]])")
            # The client went: its request is aborted on the workers and leaves the view.
            await page.wait_for(f"{rows.format('requests')}.length === 0", "the request to go")
            return seen, names

    try:
        seen, names = asyncio.run(scenario())
    finally:
        harness.stop()
    [[request, stage, prefill_worker, decode_worker, tokens]] = seen
    assert (stage, prefill_worker, decode_worker) == ("decoding", "prefill", "decode")
    assert request and int(tokens) >= 1
    assert names == [["decode", "decode"], ["prefill", "prefill"]]


def test_the_live_view_needs_the_routers_api_key_and_the_page_does_not(workers: Any) -> None:
    harness = RouterHarness(
        {}, {"colocated": workers.decode("colocated")}, None, http_port=0, api_key="k3y",
        routes=lab.routes(),
    )  # fmt: skip
    assert harness.app.http is not None
    base = harness.app.http.address
    try:
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(f"{base}/lab/live", timeout=10)
        assert refused.value.code == 401
        keyed = urllib.request.Request(f"{base}/lab/live", headers={"Authorization": "Bearer k3y"})
        state = json.load(urllib.request.urlopen(keyed, timeout=10))
        assert [w["name"] for w in state["workers"]] == ["colocated"]
        assert state["requests"] == [] and state["migrations"] == 0
        page = urllib.request.urlopen(f"{base}/lab", timeout=10).read().decode()
        assert "splitserve lab" in page and "__OPTIONS__" not in page
    finally:
        harness.stop()
