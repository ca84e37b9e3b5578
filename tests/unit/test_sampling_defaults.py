"""read_sampling_defaults: what a model's own files say an omitted sampling field is."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import pytest

from cluster.engine.model.checkpoint import open_gguf, read_sampling_defaults
from cluster.engine.model.model_files import ModelLoadError


def test_an_hf_checkpoints_generation_config_gives_its_sampling_fields(tmp_path: Path) -> None:
    config = {"temperature": 0.6, "top_p": 0.9, "do_sample": True, "max_new_tokens": 5}
    (tmp_path / "generation_config.json").write_text(json.dumps(config))
    assert read_sampling_defaults(tmp_path) == (("temperature", 0.6), ("top_p", 0.9))


def test_a_checkpoint_without_one_has_none(tmp_path: Path) -> None:
    assert read_sampling_defaults(tmp_path) == ()


def _write_gguf(path: Path, temperature: float, top_k: int | None) -> None:
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_float32("general.sampling.temp", temperature)
    if top_k is not None:
        writer.add_int32("general.sampling.top_k", top_k)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_a_ggufs_sampling_metadata_gives_them(tmp_path: Path) -> None:
    path = tmp_path / "m.gguf"
    _write_gguf(path, 0.5, 40)
    got = dict(read_sampling_defaults(path))
    assert got == {"temperature": 0.5, "top_k": 40} and isinstance(got["top_k"], int)


def test_a_gguf_is_parsed_once_per_version_of_the_file(tmp_path: Path) -> None:
    path = tmp_path / "m.gguf"
    _write_gguf(path, 0.5, 40)
    assert open_gguf(path) is open_gguf(tmp_path / "." / "m.gguf")
    # A new file at the same path is read anew (its size differs: file times may not, in
    # the same few milliseconds).
    _write_gguf(path, 0.25, None)
    assert dict(read_sampling_defaults(path)) == {"temperature": 0.25}


def test_generation_config_vllm_takes_none_and_a_folder_takes_its_own(tmp_path: Path) -> None:
    """engine.generation_config (`--generation-config`), as vLLM's: auto the model's, vllm
    none, a folder's generation_config.json in place of the model's."""
    model, other = tmp_path / "model", tmp_path / "other"
    model.mkdir()
    other.mkdir()
    (model / "generation_config.json").write_text(json.dumps({"temperature": 0.6}))
    (other / "generation_config.json").write_text(json.dumps({"top_p": 0.5}))
    assert read_sampling_defaults(model, "auto") == (("temperature", 0.6),)
    assert read_sampling_defaults(model, "vllm") == ()
    assert read_sampling_defaults(model, str(other)) == (("top_p", 0.5),)
    with pytest.raises(ModelLoadError, match=r"^generation_config: .*/model/generation_config"):
        read_sampling_defaults(other, str(tmp_path / "model" / "generation_config"))
