"""The generated code in splitserve_api/v1/ matches the .proto beside it: regenerate it and
compare."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GENERATED = ("splitserve_pb2.py", "splitserve_pb2.pyi", "splitserve_pb2_grpc.py")


def _normalized(text: str) -> str:
    """Drop the lines that only record which protoc and grpc versions generated the file."""
    text = re.sub(r"ValidateProtobufRuntimeVersion\([^)]*\)", "", text)
    return "\n".join(line for line in text.splitlines() if "version" not in line.lower())


def test_generated_code_is_current(tmp_path: Path) -> None:
    # protoc runs in its own process: grpc_tools' protobuf and abseil clash with NIXL's in
    # one process (it aborts), and NIXL is loaded by the transfer tests in this one.
    env = {**os.environ, "PYTHON": sys.executable}
    subprocess.run([ROOT / "scripts" / "gen-proto", tmp_path], check=True, env=env)
    for name in GENERATED:
        fresh = (tmp_path / "splitserve_api" / "v1" / name).read_text()
        committed = (ROOT / "splitserve_api" / "v1" / name).read_text()
        assert _normalized(committed) == _normalized(fresh), (
            f"splitserve_api/v1/{name} is stale: run scripts/gen-proto"
        )
