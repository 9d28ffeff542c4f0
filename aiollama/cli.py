"""The ``aiollama`` command: run, serve, plan, bench, pull.

    aiollama run [MODEL] PROMPT...     stream the prompts side by side, with live tokens/s and batch use
    aiollama serve [MODEL]             the OpenAI-compatible server
    aiollama plan [MODEL] [FLAGS]      what serve with those flags would take, per device, before loading
    aiollama bench [ARGS...]           the benchmarks of a source checkout (benchmarks/run.py)
    aiollama pull                      fetch the default model into the cache

MODEL is a path to a GGUF file; without it the default model is used (fetched on first use).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import anyio

from aiollama import EngineConfig
from aiollama.errors import AiollamaError
from aiollama.plan_command import add_plan, run_plan
from aiollama.serve_command import add_serve, layers, serve


def _model_and_prompts(words: list[str]) -> tuple[Path | None, list[str]]:
    """``run``'s positionals: a first word naming a GGUF file is the model, the rest are prompts."""
    if words and words[0].endswith(".gguf"):
        return Path(words[0]), words[1:]
    return None, words


async def _run(args: argparse.Namespace) -> int:
    from aiollama import Engine
    from aiollama.live import Board

    model, prompts = _model_and_prompts(args.words)
    if args.model is not None:
        model, prompts = args.model, args.words
    if not prompts:
        print("aiollama run: give at least one prompt", file=sys.stderr)
        return 2
    async with Engine(model, n_ctx=args.n_ctx, n_seq_max=max(len(prompts), args.n_seq_max),
                      n_gpu_layers=args.n_gpu_layers) as engine:
        board = Board(engine, prompts)

        async def one(i: int) -> None:
            async with engine.conversation() as conv:
                stream = conv.chat(prompts[i], max_tokens=args.max_tokens, temperature=args.temperature,
                                   seed=args.seed + i)
                async for chunk in stream:
                    board.add(i, chunk.text)
                board.end(i, stream.finish_reason)

        with board.live():
            async with anyio.create_task_group() as tg:
                for i in range(len(prompts)):
                    tg.start_soon(one, i)
    return 0


def _bench(args: argparse.Namespace) -> int:
    script = Path(args.benchmarks) / "run.py"
    if not script.is_file():
        print(f"aiollama bench runs the benchmarks of a source checkout; no {script} here "
              "(run it from the repository root, or pass --benchmarks DIR)", file=sys.stderr)
        return 2
    return subprocess.call([sys.executable, str(script), *args.rest])


def _pull(args: argparse.Namespace) -> int:
    from aiollama.models import pull

    print(pull())
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="aiollama", description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n", 2)[2])
    sub = p.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="stream prompts side by side with live progress")
    run.add_argument("words", nargs="+", metavar="[MODEL] PROMPT", help="a .gguf path (optional), then prompts")
    run.add_argument("--model", type=Path, default=None, help="the GGUF file (instead of the first word)")
    run.add_argument("--max-tokens", type=int, default=256)
    run.add_argument("--temperature", type=float, default=0.7)
    run.add_argument("--seed", type=int, default=0)
    run.add_argument("--n-ctx", type=int, default=EngineConfig.n_ctx)
    run.add_argument("--n-seq-max", type=int, default=1)
    run.add_argument("--n-gpu-layers", type=layers, default=EngineConfig.n_gpu_layers,
                     help="layers on the GPU: auto (as many as fit), N, or -1 for all (default: auto)")
    add_serve(sub.add_parser("serve", help="the OpenAI-compatible server"))
    add_plan(sub.add_parser("plan", help="what a model and its flags will take, per device, before loading"))


    bench = sub.add_parser("bench", help="the benchmarks (from a source checkout)")
    bench.add_argument("--benchmarks", default=os.path.join(os.getcwd(), "benchmarks"))
    bench.add_argument("rest", nargs=argparse.REMAINDER, help="arguments for benchmarks/run.py (--quick, ...)")

    sub.add_parser("pull", help="fetch the default model into the cache")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        if args.command == "run":
            return anyio.run(_run, args)
        if args.command == "serve":
            return serve(args)
        if args.command == "plan":
            return run_plan(args)
        if args.command == "bench":
            return _bench(args)
        return _pull(args)
    except (AiollamaError, OSError) as exc:
        print(f"aiollama {args.command}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
