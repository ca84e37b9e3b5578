"""`--download` (engine.download): a Hugging Face id not in the cache is fetched through
huggingface_hub from its endpoint, here a fake hub on loopback (never the network), into
the cache (or --download-dir), where the next lookup finds it offline; without the flag it
is refused naming the cache and the flag."""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import ClassVar

import huggingface_hub.constants
import pytest

from cluster.engine.model.model_files import ModelLoadError, model_path

REPO, COMMIT = "org/tiny", "c0ffee" * 6 + "c0ff"
FILES = {"config.json": b'{"model_type": "llama"}', "tokenizer/vocab.txt": b"a\nb\n"}


class _Hub(BaseHTTPRequestHandler):
    """The hub's API as huggingface_hub's snapshot_download reads it: the revision's
    commit, its file tree, and each file by commit; the paths asked for, kept."""

    asked: ClassVar[list[str]] = []

    def log_message(self, *args: object) -> None:
        pass

    def do_HEAD(self) -> None:
        self._answer(head=True)

    def do_GET(self) -> None:
        self._answer(head=False)

    def _answer(self, head: bool) -> None:
        path = self.path.split("?")[0]
        self.asked.append(f"{self.command} {path}")
        api = f"/api/models/{REPO}"
        body, headers = b"{}", {"Content-Type": "application/json"}
        if path.startswith(f"{api}/revision/"):
            files = [{"rfilename": name} for name in FILES]
            body = json.dumps({"id": REPO, "sha": COMMIT, "siblings": files}).encode()
        elif path.startswith(f"{api}/tree/"):
            tree = [
                {"type": "file", "path": name, "size": len(data), "oid": _sha1(data)}
                for name, data in FILES.items()
            ]
            body = json.dumps(tree).encode()
        elif (
            path.startswith(f"/{REPO}/resolve/{COMMIT}/")
            and (name := path.removeprefix(f"/{REPO}/resolve/{COMMIT}/")) in FILES
        ):
            body = FILES[name]
            headers = {"X-Repo-Commit": COMMIT, "ETag": f'"{_sha1(body)}"'}
        else:
            self.send_response(404)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"{}")
            return
        self.send_response(200)
        for key, value in {**headers, "Content-Length": str(len(body))}.items():
            self.send_header(key, value)
        self.end_headers()
        if not head:
            self.wfile.write(body)


def _sha1(data: bytes) -> str:
    return hashlib.sha1(data).hexdigest()


@pytest.fixture
def hub(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Hub)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    host, port = server.server_address[:2]
    monkeypatch.setenv("HF_ENDPOINT", f"http://{host!s}:{port}")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    _Hub.asked = []
    yield _Hub.asked
    server.shutdown()
    thread.join()


def test_download_fetches_an_id_into_the_cache_and_without_it_is_refused(
    hub: list[str], tmp_path: Path
) -> None:
    cache = str(tmp_path / "hub")
    with pytest.raises(
        ModelLoadError, match=r"not in the Hugging Face cache at .*/hub \(--download"
    ):
        model_path(REPO, None, cache)
    assert hub == []  # nothing asked of the hub without the flag
    got = model_path(REPO, None, cache, download=True)
    assert got == tmp_path / "hub" / "models--org--tiny" / "snapshots" / COMMIT
    assert {
        p.relative_to(got).as_posix(): p.read_bytes() for p in got.rglob("*") if p.is_file()
    } == FILES
    asked = len(hub)
    assert model_path(REPO, None, cache, download=True) == got  # found offline now
    assert model_path(REPO, None, cache) == got
    assert len(hub) == asked


def test_a_download_the_hub_refuses_names_the_model(hub: list[str], tmp_path: Path) -> None:
    with pytest.raises(
        ModelLoadError, match=r"^model 'org/absent': --download from the hub failed"
    ):
        model_path("org/absent", None, str(tmp_path), download=True)
