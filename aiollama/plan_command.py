"""``aiollama plan MODEL [engine flags]``: what ``aiollama serve`` with the same flags would take,
per device, before anything is loaded (llama.cpp's own accounting over a model loaded with
``no_alloc``; see :mod:`aiollama.api.plan`)."""

from __future__ import annotations

import argparse
import json
import sys

from aiollama.serve_command import add_serve, engine_options


def add_plan(plan: argparse.ArgumentParser) -> None:
    add_serve(plan)
    plan.add_argument("--json", action="store_true", help="write the plan as JSON")
    plan.add_argument("--memory-gib", type=float, default=None, metavar="GIB",
                      help="also say what this much memory holds: cells, streams of this context, context per stream")


def run_plan(args: argparse.Namespace) -> int:
    from aiollama import plan

    try:
        options = engine_options(args)
    except ValueError as exc:
        print(f"aiollama plan: {exc}", file=sys.stderr)
        return 2
    found = plan(args.model, **options)
    memory = None if args.memory_gib is None else int(args.memory_gib * 2**30)
    if args.json:
        print(json.dumps(found.as_dict(memory), indent=1))
        return 0
    mib = 2**20
    print(f"{found.description} ({found.model})")
    print(f"  {found.n_gpu_layers} layers on a GPU; context {found.n_ctx} cells, {found.n_seq_max} streams of "
          f"{found.n_ctx_seq}")
    print(f"  {'buffer':<16}{'weights':>12}{'memory':>12}{'compute':>12}  (MiB)")
    for b in found.buffers:
        print(f"  {b.name:<16}{b.weights / mib:>12.1f}{b.memory / mib:>12.1f}{b.compute / mib:>12.1f}")
    print(f"  {'total':<16}{found.weights_bytes / mib:>12.1f}{found.memory_bytes / mib:>12.1f}"
          f"{found.compute_bytes / mib:>12.1f}  = {found.total_bytes / mib:.1f} MiB")
    if found.kv_bytes_per_cell:
        print(f"  KV: {found.kv_bytes_per_cell} bytes a cell, {found.kv_bytes_per_stream / mib:.1f} MiB a stream")
    if memory is not None:
        fits = found.fits(memory)
        print(f"  {args.memory_gib:g} GiB holds {fits['cells']} cells: {fits['streams']} streams of {found.n_ctx_seq}, "
              f"or {found.n_seq_max} streams of {fits['context_per_stream']}")
    return 0
