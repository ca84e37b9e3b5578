"""read_sampling_defaults: what a model's own files say an omitted sampling field is."""

from __future__ import annotations

import json
from pathlib import Path

import gguf

from cluster.engine.checkpoint import read_sampling_defaults


def test_an_hf_checkpoints_generation_config_gives_its_sampling_fields(tmp_path: Path) -> None:
    config = {"temperature": 0.6, "top_p": 0.9, "do_sample": True, "max_new_tokens": 5}
    (tmp_path / "generation_config.json").write_text(json.dumps(config))
    assert read_sampling_defaults(tmp_path) == (("temperature", 0.6), ("top_p", 0.9))


def test_a_checkpoint_without_one_has_none(tmp_path: Path) -> None:
    assert read_sampling_defaults(tmp_path) == ()


def test_a_ggufs_sampling_metadata_gives_them(tmp_path: Path) -> None:
    path = tmp_path / "m.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_float32("general.sampling.temp", 0.5)
    writer.add_int32("general.sampling.top_k", 40)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    got = dict(read_sampling_defaults(path))
    assert got == {"temperature": 0.5, "top_k": 40} and isinstance(got["top_k"], int)
