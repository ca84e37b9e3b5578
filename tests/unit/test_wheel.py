"""The wheel `pip install splitserve` gets: what it ships, and what it must not.

Built offline from a copy of the working tree (the files git tracks or would track), so
the build leaves no build/ or egg-info in the checkout; `--no-build-isolation` builds with
the venv's setuptools (grpcio-tools, a test dependency, requires it) instead of fetching
one, and `--no-index` keeps pip off the network.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from splitserve.bench import RESULTS
from splitserve.bench.serve import parse_args

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {"cluster", "decode_worker", "prefill_worker", "router", "splitserve", "splitserve_api"}
DIST_INFO = "splitserve-0.1.0.dist-info"


def copy_tree(dest: Path) -> None:
    """The checkout as git sees it, ignored files (venvs, results, caches) left out."""
    out = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    for name in out.stdout.split("\0"):
        if name and (ROOT / name).is_file():  # a file deleted but still in the index is not
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, dest / name)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> zipfile.ZipFile:
    tmp = tmp_path_factory.mktemp("wheel")
    copy_tree(tmp / "src")
    pip = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation"]
    subprocess.run([*pip, "--no-index", "-q", "-w", tmp / "dist", tmp / "src"], check=True)
    (path,) = (tmp / "dist").glob("splitserve-*.whl")
    return zipfile.ZipFile(path)


def test_the_benchmarks_ship_inside_splitserve_and_no_results_do(wheel: zipfile.ZipFile) -> None:
    names = wheel.namelist()
    assert {name.split("/")[0] for name in names} == PACKAGES | {DIST_INFO}
    assert "splitserve/bench/serve.py" in names
    assert [n for n in names if {"results", RESULTS.name} & set(n.split("/"))] == []
    entry_points = wheel.read(f"{DIST_INFO}/entry_points.txt").decode()
    assert "serve = splitserve.bench.serve:main" in entry_points.splitlines()


def test_the_license_the_proto_the_example_config_and_the_lab_page_ship(
    wheel: zipfile.ZipFile,
) -> None:
    license_text = wheel.read(f"{DIST_INFO}/licenses/LICENSE").decode()
    assert license_text.split()[:4] == ["Apache", "License", "Version", "2.0,"]
    metadata = wheel.read(f"{DIST_INFO}/METADATA").decode().splitlines()
    assert {"License-Expression: Apache-2.0", "License-File: LICENSE"} <= set(metadata)
    proto = wheel.read("splitserve_api/v1/splitserve.proto").decode()
    assert "package splitserve.v1;" in proto
    example = wheel.read("splitserve/serve.example.yaml")
    assert example == (ROOT / "splitserve" / "serve.example.yaml").read_bytes()
    lab = wheel.read("splitserve/lab.html")  # no build step, no CDN: the page is this file
    assert lab == (ROOT / "splitserve" / "lab.html").read_bytes()


def test_every_c_kernel_and_header_ships_to_be_built_where_it_runs(
    wheel: zipfile.ZipFile,
) -> None:
    engine = ROOT / "cluster" / "engine" / "kernels"
    sources = sorted([*engine.glob("*.c"), *engine.glob("*.h")])
    assert {"qmatmul.c", "paged_attention.c", "layer_ops.c"} <= {p.name for p in sources}
    for path in sources:
        assert wheel.read(f"cluster/engine/kernels/{path.name}") == path.read_bytes(), path.name


def test_results_default_to_the_current_directory() -> None:
    """A benchmark writes where it runs (or to --out), never beside its own module."""
    assert not RESULTS.is_absolute()
    args = parse_args(["--target", "h:1", "--slo-ttft", "1", "--slo-tpot", "1"])
    assert args.out == RESULTS / "serve.json"
