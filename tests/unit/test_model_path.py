"""engine.model as vLLM users give it: a path, or a Hugging Face id found in the local
Hugging Face cache (offline), with the cache named when it is not there."""

from __future__ import annotations

from pathlib import Path

import pytest

from cluster.engine.model.model_files import ModelLoadError, hf_cache, model_name, model_path


def _cached(cache: Path, repo: str, revisions: list[str], main: str | None) -> Path:
    root = cache / f"models--{repo.replace('/', '--')}"
    for rev in revisions:
        (root / "snapshots" / rev).mkdir(parents=True)
    if main is not None:
        (root / "refs").mkdir()
        (root / "refs" / "main").write_text(main + "\n")
    return root / "snapshots"


def test_an_id_resolves_to_its_main_snapshot_or_its_only_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    snapshots = _cached(tmp_path, "org/two", ["aaa", "bbb"], main="bbb")
    assert model_path("org/two") == snapshots / "bbb"
    only = _cached(tmp_path, "org/one", ["ccc"], main=None)
    assert model_path("org/one") == only / "ccc"
    assert model_name("org/one", only / "ccc") == "org/one"  # served as the id, not "ccc"


def test_an_id_not_in_the_cache_is_refused_naming_the_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(ModelLoadError) as refused:
        model_path("meta-llama/Llama-3.1-8B-Instruct")
    assert str(refused.value) == (
        f"model 'meta-llama/Llama-3.1-8B-Instruct': no such path, and not in the Hugging "
        f"Face cache at {tmp_path} (--download fetches it there, or `huggingface-cli download "
        f"meta-llama/Llama-3.1-8B-Instruct`)"
    )
    _cached(tmp_path, "org/many", ["aaa", "bbb"], main=None)
    with pytest.raises(ModelLoadError, match="2 snapshots of it, none named by refs/main"):
        model_path("org/many")


def test_a_path_is_taken_as_given(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    (tmp_path / "org" / "local").mkdir(parents=True)  # a directory that looks like an id
    assert model_path("org/local") == Path("org/local")
    assert model_name("org/local", Path("org/local")) == "local"
    assert model_path("/no/such/model.gguf") == Path("/no/such/model.gguf")  # loaders refuse
    assert model_name("x.gguf", Path("x.gguf")) == "x"


def test_the_cache_is_found_as_huggingface_hub_finds_it(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("HF_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    assert hf_cache() == Path.home() / ".cache" / "huggingface" / "hub"
    monkeypatch.setenv("XDG_CACHE_HOME", "/x")
    assert hf_cache() == Path("/x/huggingface/hub")
    monkeypatch.setenv("HF_HOME", "/h")
    assert hf_cache() == Path("/h/hub")
    monkeypatch.setenv("HF_HUB_CACHE", "/c")
    assert hf_cache() == Path("/c")


def test_a_revision_and_a_download_dir_pick_the_snapshot(tmp_path: Path) -> None:
    """vLLM's --revision (a branch or tag under refs/, or a commit) and --download-dir (the
    hub cache to look in, in place of $HF_HUB_CACHE)."""
    snapshots = _cached(tmp_path, "org/m", ["aaa", "bbb", "ccc"], main="bbb")
    (snapshots.parent / "refs" / "v2").write_text("ccc")
    cache = str(tmp_path)
    assert model_path("org/m", None, cache) == snapshots / "bbb"
    assert model_path("org/m", "v2", cache) == snapshots / "ccc"
    assert model_path("org/m", "aaa", cache) == snapshots / "aaa"
    with pytest.raises(ModelLoadError) as refused:
        model_path("org/m", "v3", cache)
    assert str(refused.value) == (
        f"model 'org/m': no such path, and revision 'v3' not in the Hugging Face cache at "
        f"{tmp_path} (--download fetches it there, or `huggingface-cli download org/m "
        f"--revision v3 --cache-dir {tmp_path}`)"
    )
