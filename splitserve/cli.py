"""The `splitserve` command: generated text to stdout, logs to stderr."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import os
import sys
import uuid
from collections.abc import Sequence
from functools import partial
from importlib.metadata import entry_points
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc

from cluster.config import (
    DTYPES,
    KV_CACHE_DTYPES,
    QUANTIZATIONS,
    ConfigError,
    EngineConfig,
    engine_config_from_dict,
    load_engine_config,
)
from cluster.engine.model.model_files import ModelLoadError
from cluster.types import InvalidRequestError, SamplingParams
from splitserve.serve_flags import API_KEY, BY_NAME, add_serve_flags, serve_config

if TYPE_CHECKING:
    from splitserve.client import Client


def _sampling(args: argparse.Namespace) -> dict[str, Any]:
    fields = ("max_tokens", "temperature", "top_p", "top_k", "seed")
    return {f: getattr(args, f) for f in fields if getattr(args, f) is not None}


def _generate(args: argparse.Namespace) -> int:
    if args.server:
        return asyncio.run(_generate_remote(args))
    from cluster.engine.engine import LLMEngine

    sampling = SamplingParams(**_sampling(args))
    base = load_engine_config(args.config) if args.config else EngineConfig()
    overrides = {
        "model": args.model,
        "dtype": args.dtype,
        "quantization": args.quantization,
        "kv_cache_gb": args.kv_cache_gb,
        "tensor_parallel_size": args.tensor_parallel_size,
    }
    fields = {**vars(base), **{k: v for k, v in overrides.items() if v is not None}}
    from splitserve.load_bars import BARS

    engine = LLMEngine(engine_config_from_dict(fields), partial(BARS.update, "model"))
    BARS.finish("model")
    prompt = args.prompt
    if args.chat:
        prompt = engine.tokenizer.encode_chat([{"role": "user", "content": prompt}])
    rid = engine.add_request(prompt, sampling)
    try:
        while engine.has_unfinished():
            for out in engine.step():
                if out.request_id == rid:
                    sys.stdout.write(out.new_text)
                    sys.stdout.flush()
    finally:
        engine.close()
    sys.stdout.write("\n")
    return 0


async def _generate_remote(args: argparse.Namespace) -> int:
    from splitserve.client import Prompt

    prompt: Prompt = args.prompt
    if args.chat:
        prompt = [{"role": "user", "content": args.prompt}]
    wait = {"timeout_s": args.wait_s, "wait_for_ready": True} if args.wait_s else {}
    async with _client(args) as client:
        async for piece in client.stream(prompt, **wait, **_sampling(args)):
            sys.stdout.write(piece.text)
            sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def _chat(args: argparse.Namespace) -> int:
    return asyncio.run(_chat_loop(args))


async def _chat_loop(args: argparse.Namespace) -> int:
    """Read a line, stream the reply, keep the conversation (and its session) going."""
    session = uuid.uuid4().hex
    messages = [{"role": "system", "content": args.system}] if args.system else []
    interactive = sys.stdin.isatty()
    async with _client(args) as client:
        while True:
            if interactive:
                print("you> ", end="", flush=True)
            line = await asyncio.to_thread(sys.stdin.readline)
            if not line or line.strip() in ("/exit", "/quit"):
                return 0
            if not line.strip():
                continue
            messages.append({"role": "user", "content": line.strip()})
            reply: list[str] = []
            async for piece in client.stream(messages, session_id=session, **_sampling(args)):
                reply.append(piece.text)
                sys.stdout.write(piece.text)
                sys.stdout.flush()
                if piece.finish_reason and args.verbose:
                    u = piece.usage
                    print(
                        f"\n[{u.prompt_tokens} prompt tokens, {u.cached_prompt_tokens} cached, "
                        f"{u.completion_tokens} generated; first token "
                        f"{piece.timing.first_token_ms:.0f} ms]",
                        file=sys.stderr,
                    )
            sys.stdout.write("\n")
            messages.append({"role": "assistant", "content": "".join(reply)})


def _client(args: argparse.Namespace) -> Client:
    """A client of --server with its key (--api-key, else $SPLITSERVE_API_KEY, else none),
    over TLS when --ssl-ca names the certificate to trust."""
    from splitserve.client import Client

    if args.ssl_ca is not None and not Path(args.ssl_ca).is_file():
        raise ConfigError(f"--ssl-ca: {args.ssl_ca}: no such file")
    key = args.api_key or os.environ.get(API_KEY.env) or None
    return Client(args.server, key, args.ssl_ca)


def _serve(args: argparse.Namespace) -> int:
    from splitserve.launch import serve

    return serve(serve_config(args, os.environ))


def _plan(args: argparse.Namespace) -> int:
    from cluster.engine.model.checkpoint import read_spec
    from cluster.engine.model.model_files import model_path
    from splitserve.capacity import ARCHITECTURES
    from splitserve.hardware import GPUS, measure

    if args.kind == "calibrate":
        return _calibrate(args)
    spec = ARCHITECTURES.get(args.model) or read_spec(model_path(args.model))
    if args.hardware == "this" or args.measure:
        hw = measure(args.measure_budget_s, refresh=args.measure)
    elif args.hardware in GPUS:
        hw = GPUS[args.hardware]
    else:
        raise ConfigError(f"hardware: one of {[*GPUS, 'this']}, got {args.hardware!r}")
    if args.kind == "cluster":
        from splitserve.plan import plan_cluster

        print(plan_cluster(args, spec, hw))
        return 0
    from splitserve.plan import plot_capacity, report

    contexts = [int(c) for c in args.contexts.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    if args.plot:
        title = f"{args.model}: KV {args.kv_dtype}, pages of {args.page_size}"
        plot_capacity(spec, args.kv_dtype, args.page_size, contexts, Path(args.plot), title)
    if args.tensor_parallel_size < 1:
        raise ConfigError(f"tensor_parallel_size: at least 1, got {args.tensor_parallel_size}")
    if args.tp_link_gb_s <= 0:
        raise ConfigError(f"tp_link_gb_s: a bandwidth > 0, got {args.tp_link_gb_s:g}")
    print(report(args.model, spec, hw, args.kv_dtype, args.page_size, args.kv_cache_gb,
                 contexts, batches, args.tensor_parallel_size, args.tp_link_gb_s))  # fmt: skip
    return 0


def _lab(args: argparse.Namespace) -> int:
    from splitserve.lab import measured, serve

    if not args.plan_only:
        raise ConfigError(
            "lab: the live view is part of a serving router, at its HTTP API's /lab "
            "(http://127.0.0.1:8000/lab under `splitserve serve`'s defaults); --plan-only "
            "serves the capacity explorer alone"
        )
    points = measured(Path(args.kv_capacity)) if args.kv_capacity else None
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(args.port, points))
    return 0


def _calibrate(args: argparse.Namespace) -> int:
    from splitserve.calibrate import calibrate
    from splitserve.capacity import ARCHITECTURES
    from splitserve.step_cost import default_path

    if args.model in ARCHITECTURES and args.model != "smollm2-135m":
        raise ConfigError(
            f"model: calibrate runs the real engine, so a model file (or smollm2-135m, the "
            f"bundled one), not the architecture {args.model!r}"
        )
    model = None if args.model in ARCHITECTURES else args.model
    engine = load_engine_config(args.config) if args.config else EngineConfig()
    engine = dataclasses.replace(engine, model=model, dtype=args.dtype, threads=args.threads)
    cost, run = calibrate(engine, args.budget_s)
    if len(run.samples) < run.points:
        print(
            f"calibrate: stopped at the {args.budget_s:g} s budget after {len(run.samples)} "
            f"of {run.points} points; the fit uses those",
            file=sys.stderr,
        )
    out = Path(args.out) if args.out else default_path()
    cost.save(out)
    print(f"{cost}\nwritten to {out}")
    return 0


# The entry-point group splitserve/bench/ registers its commands in (pyproject.toml): bench
# stands on the rest of splitserve, so the CLI names no bench module and finds them as
# installed plugins.
BENCHES = "splitserve.bench"


def _bench(args: argparse.Namespace) -> int:
    """`splitserve bench KIND ...`: the main KIND's entry point names, loaded when asked for."""
    (entry,) = entry_points(group=BENCHES, name=args.kind)
    result: int = entry.load()(args.bench_args)
    return result


SSL_CA = "talk TLS, trusting this PEM certificate (the server's own, if self-signed, or its CA)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="splitserve", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser(
        "serve",
        help="run the whole cluster on this machine (gRPC and OpenAI HTTP router)",
        epilog=f"{SERVE_EXAMPLES}example config (every field, its default): {EXAMPLE_CONFIG}\n",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    serve.add_argument("--config", default=None, help="YAML config: pools, transfer, router")
    add_serve_flags(serve)
    serve.set_defaults(func=_serve)

    chat = sub.add_parser("chat", help="chat with a running server, streaming its replies")
    chat.add_argument("--server", default="127.0.0.1:50051")
    chat.add_argument("--system", default=None, help="a system message to start with")
    chat.add_argument("--api-key", default=None, help=f"the server's key (default ${API_KEY.env})")
    chat.add_argument("--ssl-ca", default=None, help=SSL_CA)
    _sampling_args(chat, max_tokens=256)
    chat.set_defaults(func=_chat)

    gen = sub.add_parser("generate", help="generate text for one prompt (local engine or server)")
    gen.add_argument("prompt")
    gen.add_argument("--server", default=None, help="ask a running server (host:port) instead")
    gen.add_argument(
        "--api-key", default=None, help=f"with --server: its key (default ${API_KEY.env})"
    )
    gen.add_argument("--ssl-ca", default=None, help=f"with --server: {SSL_CA}")
    gen.add_argument(
        "--wait-s", type=float, default=0, help="with --server: wait this long for it to be up"
    )
    gen.add_argument("--chat", action="store_true", help="wrap as one user turn (chat template)")
    _sampling_args(gen, max_tokens=128)
    for name in ("--dtype", "--quantization", "--kv-cache-gb", "--tensor-parallel-size"):
        BY_NAME[name].add_to(gen, BY_NAME[name].help)
    gen.add_argument("--model", default=None, help="GGUF file or HF checkpoint dir")
    gen.add_argument("--config", default=None, help="YAML config (its engine: section)")
    gen.set_defaults(func=_generate)

    plan = sub.add_parser(
        "plan",
        help="capacity planning: KV capacity and the memory wall, before buying hardware",
        epilog=PLAN_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    plan.add_argument("kind", choices=["capacity", "cluster", "calibrate"])
    plan.add_argument(
        "--model", default="llama-3-8b", help="a named architecture, or a .gguf / HF directory"
    )
    plan.add_argument(
        "--hardware", default="A100", help="A100, H100, H200, L40S, B200, ... or this"
    )
    plan.add_argument("--measure", action="store_true", help="measure this machine (re-cache)")
    plan.add_argument(
        "--measure-budget-s",
        type=float,
        default=20.0,
        help="seconds --measure may take (default %(default)g): bandwidth, then matmuls in "
        "this CPU's fast dtype; it stops there with what it has and says so",
    )
    plan.add_argument("--kv-cache-gb", type=float, default=40.0)
    plan.add_argument("--kv-dtype", choices=KV_CACHE_DTYPES[1:], default="bfloat16")
    plan.add_argument("--page-size", type=int, default=16)
    plan.add_argument("--plot", default=None, help="capacity, cluster: write a PNG here")
    cap = plan.add_argument_group("capacity")
    cap.add_argument("--contexts", default="512,2048,8192")
    cap.add_argument("--batches", default="1,8,64,256")
    cap.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="devices a model is split over: weights and KV per device, all-reduces per step",
    )
    plan.add_argument(
        "--tp-link-gb-s",
        type=float,
        default=300.0,
        help="each device's link to the others, GB/s each way (default %(default)g: "
        "NVLink 3, A100; NVLink 4, H100/H200: 450; PCIe 5: 64)",
    )
    sim = plan.add_argument_group("cluster (a simulation; see splitserve/sim.py)")
    sim.add_argument("--workload", default="chat", help="a splitserve/workloads name or .yaml path")
    sim.add_argument("--rate", type=float, default=4.0, help="requests (conversations) a second")
    sim.add_argument("--requests", type=int, default=2000)
    sim.add_argument("--seed", type=int, default=0)
    sim.add_argument("--burstiness", type=float, default=1.0, help="1: Poisson; < 1 burstier")
    sim.add_argument("--prefill", default="1", help="prefill workers: 2, 1-4 or 1,2,4 (a sweep)")
    sim.add_argument("--decode", default="1", help="decode workers: as --prefill")
    sim.add_argument("--slo-ttft", type=float, default=2.0, help="seconds")
    sim.add_argument("--slo-tpot", type=float, default=0.1, help="seconds")
    sim.add_argument("--config", default=None, help="a serve YAML: pools, engines, policy")
    sim.add_argument(  # the simulated model's weights: no device here for auto to read
        "--quantization", choices=[q for q in QUANTIZATIONS if q != "auto"], default="none"
    )
    sim.add_argument(
        "--calibration", default=None, help="step costs from `plan calibrate` (else roofline)"
    )
    sim.add_argument("--efficiency", type=float, default=0.5, help="of the roofline reached")
    sim.add_argument("--link-gb-s", type=float, default=25.0, help="KV transfer, per prefill")
    sim.add_argument("--prefill-tp", type=int, default=1, help="devices per prefill worker")
    sim.add_argument("--decode-tp", type=int, default=1, help="devices per decode worker")
    cal = plan.add_argument_group("calibrate (times the real engine here)")
    cal.add_argument(
        "--dtype",
        choices=DTYPES,
        default="auto",
        help="auto (the engine's: bfloat16 where this CPU has native bf16, else float32)",
    )
    cal.add_argument(
        "--budget-s",
        type=float,
        default=120.0,
        help="seconds calibrate may take, the engine's start included (default "
        "%(default)g); no grid point starts past it, and the fit uses what was timed",
    )
    cal.add_argument("--threads", type=int, default=None)
    cal.add_argument("--out", default=None, help="default: ~/.cache/splitserve/step-cost.json")
    plan.set_defaults(func=_plan)

    lab = sub.add_parser(
        "lab",
        help="the capacity plan and the cluster's live view as a web page: a serving router "
        "has it at its HTTP API's /lab; --plan-only serves the capacity explorer alone",
    )
    lab.add_argument(
        "--plan-only", action="store_true", help="the capacity explorer alone, on 127.0.0.1"
    )
    lab.add_argument("--port", type=int, default=8100, help="default %(default)s; 0: any free one")
    lab.add_argument(
        "--kv-capacity", default=None, help="a `splitserve bench kv-capacity` result to show"
    )
    lab.set_defaults(func=_lab)

    bench = sub.add_parser("bench", help="benchmarks (splitserve/bench/)")
    bench.add_argument("kind", choices=sorted(e.name for e in entry_points(group=BENCHES)))
    bench.add_argument("bench_args", nargs=argparse.REMAINDER)
    bench.set_defaults(func=_bench)
    return parser


EXAMPLE_CONFIG = Path(__file__).with_name("serve.example.yaml")  # installed with the package
SERVE_EXAMPLES = """examples:
  splitserve serve                                   # bundled model, one prefill + one decode
  splitserve serve path/to/model.gguf --quantization gguf --dtype bfloat16
  splitserve serve path/to/hf-dir --served-model-name llama --max-model-len 8192 \\
      --host 0.0.0.0 --api-key-file key.txt --port 8080 --grpc-port 50052 --decode-replicas 2
  splitserve serve --ssl-keyfile key.pem --ssl-certfile cert.pem \\
      --allowed-origins https://app.example.com   # https:// and TLS gRPC; CORS for one origin
  splitserve serve --tensor-parallel-size 2 --prefill-replicas 0   # one model on two ranks
  splitserve serve --config serve.yaml --redis-url redis://host:6379   # from the example below
  SPLITSERVE_API_KEY=$(cat key.txt) \\
      splitserve serve --config deploy/splitserve.yaml   # join a GPU Ray cluster (0.0.0.0)
  SPLITSERVE_PORT=8080 splitserve serve              # any flag: SPLITSERVE_<FLAG>
precedence: flag > SPLITSERVE_<FLAG> > the --config YAML > the default
then: curl http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \\
        -d '{"messages": [{"role": "user", "content": "Hi"}]}'
      splitserve chat                                # over gRPC on 127.0.0.1:50051
      splitserve chat --ssl-ca cert.pem              # ... over TLS, trusting that certificate
"""


PLAN_EXAMPLES = """examples:
  splitserve plan capacity --model llama-3-70b --hardware A100   # the textbook 70B case
  splitserve plan capacity --model llama-3-70b --hardware A100 --tensor-parallel-size 4
  splitserve plan capacity --model llama-3-8b --hardware H200 --kv-cache-gb 100 --plot kv.png
  splitserve plan capacity --model path/to/model.gguf --hardware this --kv-cache-gb 1
  splitserve plan cluster --model llama-3-8b --hardware H100 --workload chat --rate 40 \\
      --prefill 1-4 --decode 1-8 --plot pd.png       # which P:D meets the SLOs, cheapest
  splitserve plan calibrate --model smollm2-135m --threads 2     # time this engine's steps
  splitserve plan cluster --model smollm2-135m --hardware this --calibration \\
      ~/.cache/splitserve/step-cost.json --rate 2 --requests 200 --decode 1 --prefill 0
named architectures: smollm2-135m, llama-3-8b, llama-3-70b, qwen2-7b, mistral-7b
"""


def _sampling_args(parser: argparse.ArgumentParser, max_tokens: int) -> None:
    parser.add_argument("--max-tokens", type=int, default=max_tokens)
    parser.add_argument("--temperature", type=float, default=None, help="0 (default) = greedy")
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--seed", type=int, default=None)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        code: int = args.func(args)
    except (ConfigError, ModelLoadError, InvalidRequestError) as e:
        print(f"splitserve: error: {e}", file=sys.stderr)
        return 2
    except grpc.aio.AioRpcError as e:
        print(f"splitserve: error: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    return code


if __name__ == "__main__":
    sys.exit(main())
