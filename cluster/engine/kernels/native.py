"""Our C kernels for the CPU (qmatmul.c, paged_attention.c, layer_ops.c, and the headers
they share), built on the host that runs them and called through ctypes.

A C file is compiled once per (source and headers, compiler, CPU flags) with
`-march=native` into $XDG_CACHE_HOME/splitserve/kernels (~1 s); a later start loads it.
Hosts of one kind differ in ISA from day to day, so the CPU's flags are part of the key.
Where a file cannot be built (no C compiler, a build error) `library` returns None, the
reason logged once, and its caller keeps PyTorch's way. The kernels run their loops on
torch's OpenMP threads: there is one libgomp.so.1 in the process, so torch.set_num_threads
sets theirs too.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from cluster.engine.kernels.cpu_isa import cpu

log = logging.getLogger(__name__)

FLAGS = ("-O3", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC")  # arithmetic as written


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "splitserve" / "kernels"


def _build(compiler: str, source: Path, arch: str) -> Path:
    flags = (f"-march={arch}", *FLAGS)
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True)
    headers = [h.read_text() for h in sorted(source.parent.glob("*.h"))]  # what it includes
    key = "\n".join(
        [source.read_text(), *headers, version.stdout, " ".join(flags), " ".join(sorted(cpu()[1]))]
    )
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    target = _cache_dir() / f"{source.stem}-{digest}.so"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    log.info("compiling %s for this CPU (once; cached in %s)", source.name, target.parent)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        done = subprocess.run(
            [compiler, *flags, str(source), "-o", str(built), "-lm"],
            capture_output=True,
            text=True,
        )
        if done.returncode:
            raise OSError(f"{compiler} failed: {done.stderr.strip()[-400:]}")
        os.replace(built, target)  # atomic: workers building at once each get a whole file
    return target


@functools.cache
def library(name: str, arch: str = "native") -> ctypes.CDLL | None:
    """cluster/engine/`name` (a C file) built for `arch` (gcc's -march: this CPU, or an
    older one's instructions, as tests ask) and loaded, or None (the reason logged once)."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        log.warning("%s: no C compiler (cc, gcc) here; PyTorch's kernels run instead", name)
        return None
    try:
        return ctypes.CDLL(str(_build(compiler, Path(__file__).with_name(name), arch)))
    except (OSError, subprocess.CalledProcessError) as e:
        log.warning("%s could not be built (%s); PyTorch's kernels run instead", name, e)
        return None
