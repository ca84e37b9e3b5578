"""Imports point down a floor (docs/design.md's layout), read from the source with `ast`.

Floors are packages, lowest first; a module may import its own floor and the floors below.
A module's floor is that of the innermost package of PACKAGES it lies in (splitserve.bench
is one, inside splitserve) and nothing else: there is no per-file table.
1. cluster (types, config, protocol, engine, transfer) and splitserve_api, the code
   generated from its .proto (it imports nothing of ours).
2. decode_worker, prefill_worker: the two roles.
3. router (dispatch included). It reaches the workers through Ray with cluster.protocol's
   types, so it imports neither of them, and they do not import each other.
4. splitserve: the control plane (launch, pools, scaler, autoscale, embedded Redis), the
   client, the capacity planner with the workload model and metrics that the benchmarks
   share (workload, serve_workload, arrivals, serve_metrics: pure), and the CLI.
5. splitserve.bench: load generators, peers and reports, which drive a real server or the
   planner. It ships inside splitserve's wheel but stands on it: nothing else in splitserve
   imports it.

`splitserve bench KIND` is the one place a lower floor runs code of a higher one, and it
does so the way a framework calls a plugin: splitserve/bench/ registers each command in
pyproject.toml's "splitserve.bench" entry-point group and splitserve.cli loads it by the
name the user gives, so no file of splitserve names a bench module; the dependency in
the source points down (bench names the group). A test below holds the group to that.

What counts as an import: every `import` and `from ... import`, at module level or
inside a function, under TYPE_CHECKING or not; and every call of `import_module` or
`__import__`, whose module is its first argument: a string literal, or an f-string whose
literal head names the package (`f"splitserve.bench.{kind}"` imports from splitserve.bench;
`f"splitserve.{name}"` cannot be read, since it may name splitserve.bench). A dynamic import
of a name the test cannot read this way fails too: an arrow it cannot see is not allowed.
Every top-level directory or module with Python files (tracked or not, unless ignored by
git) is one of PACKAGES or of NOT_PACKAGES: a new one fails until it is given a floor.

Inside the engine (cluster.engine), its rooms are floors of their own, lowest first:
sched (scheduling over plain data), kernels (KV tensors, attention, C and Triton),
model (layers, checkpoints, quantization, TP), then the engine's own modules (the step,
the runner and its compiled steps, sampling). A module of a room imports its own room and
the rooms below.

Within a floor, the imports that run form no cycle: those inside functions count (a
deferred import still ties the two modules together), those under `if TYPE_CHECKING:`,
which never run, do not. Within the router, those count too: a type-only arrow is how a
circle hid there (request -> tokenize_pool -> router -> request, opened by router/errors.py),
and the router defers no heavy import that would need one.
"""

from __future__ import annotations

import ast
import graphlib
import subprocess
import sys
import tomllib
from collections.abc import Collection, Iterator
from importlib.metadata import entry_points
from pathlib import Path

from splitserve.cli import BENCHES

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {
    "cluster": 1,
    "splitserve_api": 1,
    "decode_worker": 2,
    "prefill_worker": 2,
    "router": 3,
    "splitserve": 4,
    "splitserve.bench": 5,
}
TOP_LEVEL = {package.split(".")[0] for package in PACKAGES}
ROOMS = {  # cluster.engine's rooms, lowest first
    "cluster.engine.sched": 1,
    "cluster.engine.kernels": 2,
    "cluster.engine.model": 3,
    "cluster.engine": 4,
}
NOT_PACKAGES = {"tests"}  # may import any floor; nothing imports it
STRANGERS = {"decode_worker", "prefill_worker", "router"}  # none imports another
FLOOR_NAMES = {1: "ground", 2: "workers", 3: "router", 4: "control plane", 5: "bench"}
DYNAMIC = {"import_module", "__import__"}
UNREADABLE = "<a name the test cannot read>"


def floor(module: str) -> int | None:
    """The module's floor: its innermost package's of PACKAGES; None for what is not ours."""
    parts = module.split(".")
    heads = (".".join(parts[:n]) for n in range(len(parts), 0, -1))
    return next((PACKAGES[h] for h in heads if h in PACKAGES), None)


def room(module: str) -> int | None:
    """The engine room a module lies in (ROOMS), None outside the engine."""
    parts = module.split(".")
    heads = (".".join(parts[:n]) for n in range(len(parts), 0, -1))
    return next((ROOMS[h] for h in heads if h in ROOMS), None)


def python_files() -> list[Path]:
    """Every .py file git tracks or would track (ignored ones, such as .venv, left out)."""
    out = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "--", "*.py"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    return [ROOT / line for line in out.stdout.splitlines() if (ROOT / line).is_file()]


def top_level_names(files: list[Path]) -> set[str]:
    """The first part of each file's path: a directory, or a module at the root."""
    return {f.relative_to(ROOT).with_suffix("").parts[0] for f in files}


def sources() -> Iterator[tuple[str, Path]]:
    for path in python_files():
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        if floor(module) is not None:
            yield module.removesuffix(".__init__"), path


def _literal_head(arg: ast.expr) -> str:
    """The module a dynamic import's argument names: a literal whole, or an f-string's
    literal head up to its last dot; UNREADABLE when neither names it absolutely."""
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        return arg.value if arg.value and not arg.value.startswith(".") else UNREADABLE
    if isinstance(arg, ast.JoinedStr):
        head = ""
        for part in arg.values:
            if not (isinstance(part, ast.Constant) and isinstance(part.value, str)):
                break
            head += part.value
        if "." in head:
            named = _literal_head(ast.Constant(head.rpartition(".")[0]))
            # A head that holds a package of its own floor (splitserve holds splitserve.bench)
            # does not say which floor the import reaches.
            if not any(p.startswith(f"{named}.") for p in PACKAGES):
                return named
    return UNREADABLE


def _dynamic_import(node: ast.Call) -> str | None:
    """The module an `import_module(...)` or `__import__(...)` call imports, else None."""
    func = node.func
    name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
    if name not in DYNAMIC:
        return None
    return _literal_head(node.args[0]) if node.args else UNREADABLE


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
        elif isinstance(node, ast.Call) and (target := _dynamic_import(node)) is not None:
            yield node.lineno, target


def violations(module: str, path: Path) -> Iterator[str]:
    """Each import in the file that points up a floor, or between two STRANGERS, and
    each dynamic import whose module the test cannot read."""
    here, home = floor(module), module.split(".")[0]
    assert here is not None, f"{module}: not in a package of PACKAGES"
    for line, target in imports(module, path):
        if target == UNREADABLE:
            yield f"{module}:{line} imports {UNREADABLE}"
            continue
        there = floor(target)
        if there is None:
            continue
        stranger = home in STRANGERS and target.split(".")[0] in STRANGERS - {home}
        if there > here or stranger:
            yield f"{module}:{line} ({FLOOR_NAMES[here]}) imports {target} ({FLOOR_NAMES[there]})"


def room_violations(module: str, path: Path) -> Iterator[str]:
    """Each import in an engine module that points up a room (ROOMS)."""
    here = room(module)
    if here is None:
        return
    for line, target in imports(module, path):
        there = room(target)
        if there is not None and there > here:
            yield f"{module}:{line} imports {target}, a room above its own"


def _typing_only(path: Path) -> set[int]:
    """The lines of the imports under `if TYPE_CHECKING:`, which never run."""
    lines: set[int] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.If) and ast.unparse(node.test).endswith("TYPE_CHECKING"):
            body = (n for stmt in node.body for n in ast.walk(stmt))
            lines |= {n.lineno for n in body if isinstance(n, ast.Import | ast.ImportFrom)}
    return lines


def owner(target: str, modules: Collection[str]) -> str | None:
    """The module of `modules` an import's target is or lies in (`a.b.Name`: `a.b`)."""
    while target and target not in modules:
        target = target.rpartition(".")[0]
    return target or None


def import_graph(modules: dict[str, Path], typing: bool = False) -> dict[str, set[str]]:
    """For each module, the others of `modules` its imports that run reach (with `typing`,
    those under TYPE_CHECKING too)."""
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        skip = set() if typing else _typing_only(path)
        targets = (owner(t, modules) for line, t in imports(module, path) if line not in skip)
        graph[module] = {t for t in targets if t is not None and t != module}
    return graph


def cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle (its modules in order, the first repeated last), or []."""
    try:
        list(graphlib.TopologicalSorter(graph).static_order())
    except graphlib.CycleError as e:
        return list(e.args[1])
    return []


def unknown(names: set[str]) -> list[str]:
    """The top-level names that are neither a floor's package nor one of NOT_PACKAGES."""
    return sorted(names - TOP_LEVEL - NOT_PACKAGES)


def test_no_module_imports_a_floor_above_its_own() -> None:
    found = [v for module, path in sources() for v in violations(module, path)]
    assert found == []


def test_no_engine_module_imports_a_room_above_its_own() -> None:
    found = [v for module, path in sources() for v in room_violations(module, path)]
    assert found == []
    assert {m for m, _ in sources() if room(m) is not None} >= ROOMS.keys()


def test_an_upward_import_between_rooms_is_caught(tmp_path: Path) -> None:
    """The check itself: the scheduler importing a kernel, a kernel importing the model
    (under TYPE_CHECKING too) or the engine; the model importing kernels and sched, the
    engine importing any room, and code outside the engine, pass."""
    e = "cluster.engine"
    cases = [  # (module, its text, points up a room)
        (f"{e}.sched.scheduler", f"from {e}.kernels.kv_cache import KVCache\n", True),
        (f"{e}.kernels.kv_cache", f"if TYPE_CHECKING:\n    import {e}.model.model\n", True),
        (f"{e}.kernels.attention", f"from {e}.engine import LLMEngine\n", True),
        (f"{e}.model.model", f"from {e} import runner\n", True),
        (f"{e}.model.model", f"from {e}.kernels import attention\n", False),
        (f"{e}.kernels.attention_cpu", f"from {e}.sched.page_pool import pages_for\n", False),
        (f"{e}.runner", f"from {e}.model.model import LlamaModel\n", False),
        ("cluster.transfer.endpoint", f"from {e}.engine import LLMEngine\n", False),
    ]
    path = tmp_path / "m.py"
    for module, text, up in cases:
        path.write_text(text)
        assert bool(list(room_violations(module, path))) == up, (module, text)


def test_no_import_cycle() -> None:
    assert cycle(import_graph(dict(sources()))) == []


def test_no_import_cycle_in_the_router_not_even_for_types() -> None:
    router = {m: p for m, p in sources() if floor(m) == PACKAGES["router"]}
    assert "router.errors" in router
    assert cycle(import_graph(router, typing=True)) == []


def test_every_top_level_python_directory_has_a_floor() -> None:
    names = top_level_names(python_files())
    assert unknown(names) == []
    assert dict(sources()).keys() >= PACKAGES.keys(), "a package named here is gone"
    assert "splitserve.cli" in dict(sources())


def test_bench_commands_are_plugins_of_the_cli() -> None:
    """Every command of `splitserve bench` is a bench module's, and what is installed is
    what pyproject.toml declares (after editing the group: pip install -e .)."""
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]
    commands = declared[BENCHES]
    assert {floor(target.partition(":")[0]) for target in commands.values()} == {
        PACKAGES["splitserve.bench"]
    }
    assert {e.name: e.value for e in entry_points(group=BENCHES)} == commands


def test_an_upward_import_is_caught(tmp_path: Path) -> None:
    """The check itself: a router module that imports a worker, a worker that imports
    its peer, a ground-floor module that imports the control plane from inside a
    function or relatively; what the old per-module table let through (the CLI, the
    planner or the workload model importing the benchmarks, the router importing code
    under splitserve/); splitserve importing splitserve.bench, relatively too; dynamic
    imports that point up or cannot be read. Imports that point down pass, dynamic ones
    too."""
    bad = {
        "router.bad": "from decode_worker.worker import DecodeWorker\n",
        "decode_worker.bad": "import prefill_worker.sender\n",
        "cluster.engine.bad": "def f():\n    from splitserve import pool\n",
        "cluster.bad": "from ..splitserve import launch\n",
        "splitserve.arrivals": "from splitserve.bench import serve\n",
        "splitserve.cli": "from splitserve.bench.serve import main\n",
        "splitserve.plan": "from splitserve.bench.serve_workload import load_workload\n",
        "router.request": "from splitserve.v1 import splitserve_pb2\n",
        "router.dynamic": "import importlib\nimportlib.import_module('splitserve.launch')\n",
        "cluster.dunder": "__import__('router.server')\n",
        "splitserve.launch": "from .bench import serve\n",
        "splitserve.fstring": "__import__(f'splitserve.bench.{k}')\n",
        "splitserve.wide": "import importlib\nimportlib.import_module(f'splitserve.{k}')\n",
        "splitserve.computed": "import importlib\nimportlib.import_module(name)\n",
        "splitserve.joined": "__import__('splitserve.' + 'bench')\n",
        "splitserve.rel": "import importlib\nimportlib.import_module('.bench', 'splitserve')\n",
    }
    good = {
        "router.good": "from cluster.protocol import DecodeStats\nfrom . import policy\n",
        "decode_worker.good": "from .outbox import Outboxes\nimport numpy\n",
        "router.server": "from splitserve_api.v1 import splitserve_pb2\n",
        "splitserve.bench.serve": "from .. import workload\nfrom . import report\n",
        "splitserve.bench.dynamic": "import importlib\nimportlib.import_module(f'cluster.{k}')\n",
        "splitserve.down": "__import__('cluster.config')\n",
    }
    path = tmp_path / "pkg" / "m.py"
    path.parent.mkdir()
    for module, text in {**bad, **good}.items():
        path.write_text(text)
        assert bool(list(violations(module, path))) == (module in bad), module


def test_an_import_cycle_is_caught(tmp_path: Path) -> None:
    """The check itself: a cycle through a name imported from a module inside a function
    (the attention backends' old one), or through `from . import` and `import a.b`, is
    caught; a chain is not, nor a back-reference under TYPE_CHECKING, unless counted as the
    router's check counts it."""

    def graph(texts: dict[str, str], typing: bool = False) -> dict[str, set[str]]:
        paths = {module: tmp_path / f"{module}.py" for module in texts}
        for module, text in texts.items():
            paths[module].write_text(text)
        return import_graph(paths, typing)

    deferred = {
        "cluster.engine.attention": "def make():\n    from cluster.engine.cpu import Backend\n",
        "cluster.engine.cpu": "from cluster.engine.attention import StepBatch\n",
    }
    relative = {
        "router.a": "from . import b\n",
        "router.b": "from router.c import C\n",
        "router.c": "import router.a\n",
    }
    typing_only = {
        "router.request": "if TYPE_CHECKING:\n    from router.pool import Pool\n",
        "router.pool": "from router.request import Prepared\n",
    }
    chain = {
        "router.a": "from . import b\nimport torch\n",
        "router.b": "from router.c import C\n",
        "router.c": "from cluster.types import RequestId\n",
    }
    assert set(cycle(graph(deferred))) == deferred.keys()
    assert set(cycle(graph(relative))) == relative.keys()
    assert cycle(graph(typing_only)) == []
    assert cycle(graph(chain)) == []
    # The router's check counts TYPE_CHECKING: the circle it once hid is caught, and the
    # same modules with the exceptions in router.errors are not.
    hidden = {
        "router.request": "if TYPE_CHECKING:\n    from router.tokenize_pool import TokenizePool\n",
        "router.tokenize_pool": "from router.router import Overloaded\n",
        "router.router": "from router.request import Prepared\n",
    }
    opened = {**hidden, "router.tokenize_pool": "from router.errors import Overloaded\n"}
    opened["router.errors"] = "from cluster.types import FinishReason\n"
    assert set(cycle(graph(typing_only, typing=True))) == typing_only.keys()
    assert set(cycle(graph(hidden, typing=True))) == hidden.keys()
    assert cycle(graph(hidden)) == []
    assert cycle(graph(opened, typing=True)) == []


def test_an_unknown_top_level_package_is_caught() -> None:
    """A new top-level directory (or root module) with Python files has no floor until
    PACKAGES or NOT_PACKAGES names it."""
    assert unknown({*TOP_LEVEL, "tests", "gateway"}) == ["gateway"]
    assert unknown({*TOP_LEVEL, "tests", "setup"}) == ["setup"]
    assert unknown({*TOP_LEVEL, "tests"}) == []


def test_the_router_loads_without_torch_the_engine_or_a_worker() -> None:
    """A fresh interpreter that imports the router's modules leaves the engine out: the
    router reads worker stats from cluster.protocol and tokenizes without torch."""
    code = (
        "import sys, router.app, router.server, router.router\n"
        "heavy = ('torch', 'cluster.engine.engine', 'cluster.engine.model.model', "
        "'cluster.engine.runner', 'decode_worker', 'prefill_worker')\n"
        "print(sorted(m for m in sys.modules if m in heavy or m.startswith("
        "('decode_worker.', 'prefill_worker.', 'torch.'))))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]", out.stdout
