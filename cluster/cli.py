"""The `splitserve` command: generated text to stdout, logs to stderr."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from cluster.config import ConfigError, EngineConfig, engine_config_from_dict, load_engine_config
from cluster.engine.checkpoint import ModelLoadError
from cluster.types import InvalidRequestError, SamplingParams


def _generate(args: argparse.Namespace) -> int:
    from cluster.engine import LLMEngine

    sampling = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
    )
    base = load_engine_config(args.config) if args.config else EngineConfig()
    overrides = {"model": args.model, "dtype": args.dtype, "kv_cache_gb": args.kv_cache_gb}
    fields = {**vars(base), **{k: v for k, v in overrides.items() if v is not None}}
    engine = LLMEngine(engine_config_from_dict(fields))
    prompt = args.prompt
    if args.chat:
        prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
    rid = engine.add_request(prompt, sampling)
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == rid:
                sys.stdout.write(out.new_text)
                sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def _bench(args: argparse.Namespace) -> int:
    if args.kind == "transfer":
        from bench.transfer import main as transfer_main

        return transfer_main(args.bench_args)
    from bench.offline import main as offline_main

    return offline_main(args.bench_args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="splitserve", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text for one prompt on the local engine")
    gen.add_argument("prompt")
    gen.add_argument("--chat", action="store_true", help="wrap as one user turn (chat template)")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--dtype", choices=["float32", "bfloat16"], default=None)
    gen.add_argument("--model", default=None, help="GGUF file or HF checkpoint dir")
    gen.add_argument("--kv-cache-gb", type=float, default=None)
    gen.add_argument("--config", default=None, help="YAML config (its engine: section)")
    gen.set_defaults(func=_generate)

    bench = sub.add_parser("bench", help="benchmarks (bench/)")
    bench.add_argument("kind", choices=["offline", "transfer"])
    bench.add_argument("bench_args", nargs=argparse.REMAINDER)
    bench.set_defaults(func=_bench)
    return parser


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
    return code


if __name__ == "__main__":
    sys.exit(main())
