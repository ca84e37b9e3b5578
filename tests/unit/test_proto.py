"""The generated code in splitserve/v1/ matches proto/: regenerate it and compare."""

from __future__ import annotations

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
    args = [sys.executable, "-m", "grpc_tools.protoc", f"-I{ROOT / 'proto'}"]
    args += [f"--python_out={tmp_path}", f"--pyi_out={tmp_path}", f"--grpc_python_out={tmp_path}"]
    args.append(str(ROOT / "proto/splitserve/v1/splitserve.proto"))
    subprocess.run(args, check=True)
    for name in GENERATED:
        fresh = (tmp_path / "splitserve" / "v1" / name).read_text()
        committed = (ROOT / "splitserve" / "v1" / name).read_text()
        assert _normalized(committed) == _normalized(fresh), (
            f"splitserve/v1/{name} is stale: run scripts/gen-proto"
        )
