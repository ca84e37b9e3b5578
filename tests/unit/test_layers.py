"""Imports point down a floor (DESIGN.md's layout), read from the source with `ast`.

Floors, lowest first; a module may import its own floor and the floors below:
1. cluster (types, config, protocol, engine, transfer) and splitserve_api, the
   code generated from proto/ (it imports nothing of ours).
2. decode_worker, prefill_worker: the two roles.
3. router (dispatch included). It reaches the workers through Ray with cluster.protocol's
   types, so it imports neither of them, and they do not import each other.
4. splitserve: the control plane (launch, pools, scaler, autoscale, embedded Redis), the
   client and the capacity planner, with the workload model and metrics that the
   benchmarks share (workload, serve_workload, arrivals, serve_metrics: pure).
5. bench: load generators, peers and reports, which drive a real server or the planner.
6. splitserve.cli: the one command line, `splitserve bench ...` included.
Every import counts, at module level or inside a function, under TYPE_CHECKING or not.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {
    "cluster": 1,
    "splitserve_api": 1,
    "decode_worker": 2,
    "prefill_worker": 2,
    "router": 3,
    "splitserve": 4,
    "bench": 5,
}
# Modules whose floor is not their package's, longest prefix first.
MODULES = {
    "splitserve.cli": 6,
}
STRANGERS = {"decode_worker", "prefill_worker", "router"}  # none imports another
FLOOR_NAMES = {1: "ground", 2: "workers", 3: "router", 4: "control plane", 5: "bench", 6: "cli"}


def floor(module: str) -> int | None:
    """The module's floor; None for what is not ours (stdlib, third party)."""
    for name in sorted(MODULES, key=len, reverse=True):
        if module == name or module.startswith(name + "."):
            return MODULES[name]
    return PACKAGES.get(module.split(".")[0])


def sources() -> Iterator[tuple[str, Path]]:
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            yield ".".join(path.relative_to(ROOT).with_suffix("").parts), path


def imports(module: str, path: Path) -> Iterator[tuple[int, str]]:
    """(line, imported module) for every import in the file, relative ones resolved."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from ((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1]
            target = ".".join(base) if node.level else ""
            if node.module:
                target = f"{target}.{node.module}" if target else node.module
            # `from pkg import mod` imports pkg.mod when it is a module: judge each name.
            yield from ((node.lineno, f"{target}.{alias.name}") for alias in node.names)


def violations(module: str, path: Path) -> Iterator[str]:
    """Each import in the file that points up a floor, or between two STRANGERS."""
    here, home = floor(module), module.split(".")[0]
    assert here is not None, module
    for line, target in imports(module, path):
        there = floor(target)
        if there is None:
            continue
        stranger = home in STRANGERS and target.split(".")[0] in STRANGERS - {home}
        if there > here or stranger:
            yield f"{module}:{line} ({FLOOR_NAMES[here]}) imports {target} ({FLOOR_NAMES[there]})"


def test_no_module_imports_a_floor_above_its_own() -> None:
    found = [v for module, path in sources() for v in violations(module, path)]
    assert found == []


def test_every_module_named_here_is_in_the_tree() -> None:
    modules = [m for m, _ in sources()]
    for name in MODULES:
        assert any(m == name or m.startswith(name + ".") for m in modules), name


def test_an_upward_import_is_caught(tmp_path: Path) -> None:
    """The check itself: a router module that imports a worker, a worker that imports
    its peer, a ground-floor module that imports the control plane from inside a
    function or relatively; and imports that point down pass."""
    bad = {
        "router.bad": "from decode_worker.worker import DecodeWorker\n",
        "decode_worker.bad": "import prefill_worker.sender\n",
        "cluster.engine.bad": "def f():\n    from splitserve import pool\n",
        "cluster.bad": "from ..splitserve import launch\n",
        "splitserve.arrivals": "from bench import serve\n",
    }
    good = {
        "router.good": "from cluster.protocol import DecodeStats\nfrom . import policy\n",
        "decode_worker.good": "from .outbox import Outboxes\nimport numpy\n",
        "splitserve.cli": "from bench.serve import main\n",
        "router.server": "from splitserve_api.v1 import splitserve_pb2\n",
    }
    path = tmp_path / "pkg" / "m.py"
    path.parent.mkdir()
    for module, text in {**bad, **good}.items():
        path.write_text(text)
        assert bool(list(violations(module, path))) == (module in bad), module


def test_the_router_loads_without_torch_the_engine_or_a_worker() -> None:
    """A fresh interpreter that imports the router's modules leaves the engine out: the
    router reads worker stats from cluster.protocol and tokenizes without torch."""
    code = (
        "import sys, router.app, router.server, router.router\n"
        "heavy = ('torch', 'cluster.engine.engine', 'cluster.engine.model', "
        "'cluster.engine.runner', 'decode_worker', 'prefill_worker')\n"
        "print(sorted(m for m in sys.modules if m in heavy or m.startswith("
        "('decode_worker.', 'prefill_worker.', 'torch.'))))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]", out.stdout
