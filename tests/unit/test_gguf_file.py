"""GGUFFile reads what gguf's own GGUFReader reads: every metadata value, every tensor's
name, kind, shape and bytes; a file cut short is refused when opened."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader

from cluster.engine.model.checkpoint import open_gguf
from cluster.engine.model.gguf_file import GGUFFile
from cluster.engine.model.model_files import ModelLoadError, bundled_model_path


def test_the_bundled_model_reads_as_ggufs_own_reader_reads_it() -> None:
    path = bundled_model_path()
    ours, theirs = GGUFFile(path), GGUFReader(str(path))
    # GGUF.*: the reader's own entries for the header's counts, not metadata
    assert ours.fields.keys() == {k for k in theirs.fields if not k.startswith("GGUF.")}
    for key, value in ours.fields.items():
        assert value == theirs.fields[key].contents(), key
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for mine, t in zip(ours.tensors, theirs.tensors, strict=True):
        assert mine.kind == t.tensor_type
        assert mine.shape == tuple(reversed(t.shape.tolist()))
        assert mine.data.dtype == t.data.dtype and mine.data.shape == t.data.shape
        assert np.array_equal(mine.data, t.data), t.name
    assert len(ours.tensors) > 0 and not ours.tensors[0].data.flags.writeable


def test_a_file_cut_short_is_refused_naming_it(tmp_path: Path) -> None:
    data = bundled_model_path().read_bytes()
    for size in (3, 1000, len(data) // 2):
        cut = tmp_path / f"cut-{size}.gguf"
        cut.write_bytes(data[:size])
        with pytest.raises(ModelLoadError, match=f"{cut}: not a valid GGUF file"):
            open_gguf(cut)
