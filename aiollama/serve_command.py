"""``aiollama serve``: its flags, and the server they describe, in one process or as Ray Serve
replicas. Both are built from the same options (``engine_options``, ``app_options``), so a flag
reaches every replica as it reaches the single server."""

from __future__ import annotations

import argparse
import signal
import sys
import time
from pathlib import Path
from typing import Any

from aiollama import EngineConfig, __version__
from aiollama.config import REASONING_MODES
from aiollama.errors import AiollamaError
from aiollama.formats.chat import REASONING_FORMATS
from aiollama.serve_flags import llama_server_flags, request_defaults

# the cells each request gets by default in the server's split cache
SLOT_CELLS = 2048


def serve_n_ctx(args: argparse.Namespace) -> int:
    if args.n_ctx is not None:
        return int(args.n_ctx)
    return EngineConfig.n_ctx if args.unified_cache else max(EngineConfig.n_ctx, SLOT_CELLS * args.n_seq_max)


def layers(text: str) -> int | str:
    if text == "auto":
        return text
    if text == "all":
        return -1
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"auto, all or a number of layers, not {text!r}") from None
    if value < -1:
        raise argparse.ArgumentTypeError(f"a number of layers is -1 (all) or more, not {value}")
    return value


def switch(text: str) -> bool | None:
    choices: dict[str, bool | None] = {"on": True, "off": False, "auto": None}
    if text not in choices:
        raise argparse.ArgumentTypeError(f"on, off or auto, not {text!r}")
    return choices[text]


def add_serve(serve: argparse.ArgumentParser) -> None:
    """``aiollama serve``'s flags."""
    serve.add_argument("model", nargs="?", type=Path, default=None, help="the GGUF file (default model if omitted)")
    serve.add_argument("-m", "--model", dest="model_option", type=Path, default=None, metavar="MODEL",
                       help="the GGUF file, as llama-server takes it")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--model-name", "-a", "--alias", default=None,
                       help="the id /v1/models reports (default: the file name)")
    serve.add_argument("--n-ctx", "-c", "--ctx-size", type=int, default=None,
                       help="KV cells in all: each request's share is n_ctx / n_seq_max with the split cache "
                            f"(default: {SLOT_CELLS} a request), all of them with --unified-cache "
                            f"(default: {EngineConfig.n_ctx})")
    serve.add_argument("--n-seq-max", "-np", "--parallel", type=int, default=EngineConfig.n_seq_max,
                       help="generations that share a batch (llama-server's slots)")
    serve.add_argument("--max-queued", type=int, default=256)
    serve.add_argument("--n-batch", "-b", "--batch-size", type=int, default=EngineConfig.n_batch,
                       help="the most prompt tokens one decode takes")
    serve.add_argument("--threads", "-t", type=int, default=None,
                       help="CPU threads (default: one per physical core this process may use, as llama-server)")
    serve.add_argument("--host-cache-mib", "-cram", "--cache-ram", type=int, default=EngineConfig.host_cache_bytes >> 20,
                       help="host memory for parked KV states, MiB (0: off)")
    serve.add_argument("--cache-dir", default=None,
                       help="a directory for the prefix cache's tier on disk: cached prefixes survive a restart, "
                            "and servers of one host may share it (default: none)")
    serve.add_argument("--cache-disk-gib", type=float, default=EngineConfig.cache_disk_bytes / 2**30,
                       help="the most the --cache-dir directory holds, GiB (least recently used files go first)")
    serve.add_argument("--checkpoint-mib", type=int, default=EngineConfig.checkpoint_bytes >> 20,
                       help="host memory for checkpoints of a recurrent or hybrid model's states, MiB (0: off)")
    serve.add_argument("--n-gpu-layers", "-ngl", "--gpu-layers", type=layers, default=EngineConfig.n_gpu_layers,
                       help="layers on the GPU: auto (as many as fit, with llama.cpp's own fitting), N, or -1 "
                            "for all; 0 keeps everything on the CPU (default: auto)")
    serve.add_argument("--cache-type-k", "-ctk", default=EngineConfig.cache_type_k,
                       help="the KV cache's key type: f16, bf16, f32, q8_0, q5_1, q5_0, q4_1, q4_0 (default: f16)")
    serve.add_argument("--cache-type-v", "-ctv", default=EngineConfig.cache_type_v,
                       help="the KV cache's value type, as the key's (a quantized one needs flash attention)")
    serve.add_argument("--flash-attn", "-fa", type=switch, default=EngineConfig.flash_attn,
                       help="flash attention: on, off or auto (default: auto, llama.cpp chooses)")
    serve.add_argument("--draft-tokens", "--draft", "--draft-n", "--draft-max", type=int, default=EngineConfig.draft_tokens,
                       help="speculation: draft up to this many tokens a step (0: off, or the engine's "
                            "default with --draft-model)")
    serve.add_argument("--draft-model", "-md", "--model-draft", "--spec-draft-model", default=None,
                       help="a smaller GGUF model with the same vocabulary that drafts instead of n-grams")
    serve.add_argument("--mtp", action="store_true",
                       help="draft with the model's own multi-token-prediction layers (a GGUF that carries them)")
    serve.add_argument("--backend-sampling", "-bs", action="store_true",
                       help="sample inside the decode graph where a stream's sampler allows it (pays on a GPU)")
    serve.add_argument("--overlap", type=switch, default=EngineConfig.overlap,
                       help="plan and start each decode before the last step's tokens are delivered: on, off or "
                            "auto (default: auto, on where the decode runs on a GPU)")
    cache = serve.add_mutually_exclusive_group()
    cache.add_argument("--split-cache", "-no-kvu", "--no-kv-unified", dest="unified_cache", action="store_false",
                       help="each request's cells its own share of the cache, as llama-server's slots (the default): "
                            "its attention reads only its own cells, and what finished requests cached never slows "
                            "the running ones")
    cache.add_argument("--unified-cache", "-kvu", "--kv-unified", dest="unified_cache", action="store_true",
                       help="one cache for every request: a request may hold any share of it and forks share "
                            "cells, but every step's attention passes over every used cell")
    serve.set_defaults(unified_cache=False)
    serve.add_argument("--api-key", action="append", default=[],
                       help="a key every request but /health must carry (Authorization: Bearer KEY); repeat it for "
                            "several; also $AIOLLAMA_API_KEY (comma-separated)")
    serve.add_argument("--api-key-file", default=None, help="a file of keys, one a line")
    serve.add_argument("--public-metrics", action="store_true", help="/metrics needs no key")
    serve.add_argument("--max-body-mib", type=int, default=8, help="the largest request body, in MiB (413 past it)")
    serve.add_argument("--max-json-depth", type=int, default=64, help="the deepest nesting of a request body")
    serve.add_argument("--max-streams-per-key", type=int, default=0,
                       help="requests in flight per key (all requests together without keys); 0: no limit (429 past it)")
    serve.add_argument("--deterministic", action="store_true",
                       help="each conversation's output independent of what runs beside it (CPU only)")
    serve.add_argument("--replicas", type=int, default=1,
                       help="engines behind this endpoint, as Ray Serve replicas on this machine (needs aiollama[ray])")
    serve.add_argument("--grace", type=float, default=30.0, help="seconds running requests get on shutdown")
    serve.add_argument("--lora", action="append", default=[], metavar="[NAME=]PATH",
                       help="a LoRA adapter to load (repeat for several); requests choose with "
                            "lora=[{'id' or 'name', 'scale'}] (id: its place among these, from 0)")
    serve.add_argument("--mmproj", "-mm", type=Path, default=None,
                       help="the model's image projector (an mmproj GGUF): chat messages may hold image_url parts")
    serve.add_argument("--fetch-images", action="store_true",
                       help="fetch image_url parts that name http(s) URLs (by default only data: URLs are read); "
                            "never from this machine's or a private network's addresses unless allowed below")
    serve.add_argument("--allowed-media-domains", nargs="+", default=[], metavar="DOMAIN",
                       help="with --fetch-images, fetch only from these domains (and their subdomains)")
    serve.add_argument("--fetch-private-addresses", action="store_true",
                       help="with --fetch-images, fetch from loopback, private and link-local addresses too")
    serve.add_argument("--responses-max", type=int, default=256, metavar="N",
                       help="stored responses (for previous_response_id) kept at most; the oldest go first")
    serve.add_argument("--responses-ttl", type=float, default=3600.0, metavar="SECONDS",
                       help="how long a stored response is kept")
    serve.add_argument("--responses-mib", type=int, default=256, metavar="MIB",
                       help="memory stored responses may hold, their conversations' KV cells and pictures counted")
    serve.add_argument("--responses-db", type=Path, default=None, metavar="PATH",
                       help="keep stored responses in this SQLite file too: previous_response_id goes on after a "
                            "restart (several servers on one host may share it)")
    serve.add_argument("--chat-template", default=None,
                       help="a chat template (Jinja) in place of the one the model's GGUF carries, or lacks")
    serve.add_argument("--chat-template-file", type=Path, default=None, help="the same, from a file")
    serve.add_argument("--reasoning", "-rea", choices=REASONING_MODES, default="auto",
                       help="the template's thinking switch by default: auto (on where the template has one), "
                            "on or off")
    serve.add_argument("--reasoning-format", choices=REASONING_FORMATS, default="auto",
                       help="how replies' thinking is returned, for requests that give no reasoning_format: "
                            "auto or deepseek (in reasoning_content), none (left in the content), deepseek-legacy "
                            "(in both)")
    serve.add_argument("--reasoning-budget", type=int, default=None,
                       help="tokens a thinking block may run before the server closes it, for requests that give "
                            "no reasoning_budget (0: no thinking)")
    serve.add_argument("--reasoning-budget-message", default="",
                       help="written before the closing marker when the budget ends a thinking block")
    serve.add_argument("--keep", type=int, default=EngineConfig.n_keep, metavar="N",
                       help="tokens a context shift keeps at the start")
    serve.add_argument("--context-shift", action=argparse.BooleanOptionalAction, default=EngineConfig.context_shift,
                       help="a full context drops its oldest tokens past --keep, instead of ending the reply")
    serve.add_argument("--version", action="version", version=f"aiollama {__version__}")
    serve.add_argument("--log-level", default="info")
    llama_server_flags(serve)


def serve(args: argparse.Namespace) -> int:
    """Run the server the flags describe; 2 for flags that contradict each other or a missing extra."""
    try:
        from aiollama.server import create_app
        from aiollama.server.run import serve as run_server
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] not in ("starlette", "uvicorn", "prometheus_client"):
            raise  # a broken install, not a missing extra: say what it is
        print(f"aiollama serve needs the server extra: pip install 'aiollama[server]' ({exc})", file=sys.stderr)
        return 2
    from aiollama.server.guard import Limits, load_keys

    try:
        keys = load_keys(args.api_key, args.api_key_file)
        limits = Limits(args.max_body_mib << 20, args.max_json_depth, args.max_streams_per_key)
        if args.models_dir is not None or args.models_preset is not None:
            return _serve_models(args, keys, limits)
        engine, app = engine_options(args), app_options(args)
    except (OSError, ValueError, AiollamaError) as exc:
        print(f"aiollama serve: {exc}", file=sys.stderr)
        return 2
    if args.replicas > 1:
        if keys:
            print("aiollama serve: --api-key is not supported with --replicas (Ray Serve's proxy takes the "
                  "requests); put the replicas behind a gateway that checks keys", file=sys.stderr)
            return 2
        return _serve_replicas(args, engine, app)
    try:
        server = create_app(args.model, api_keys=keys, limits=limits, public_metrics=args.public_metrics,
                            load_in_background=True, **app, **engine)
    except (AiollamaError, ValueError) as exc:
        print(f"aiollama serve: {exc}", file=sys.stderr)
        return 2
    run_server(server, host=args.host, port=args.port, log_level=args.log_level, grace=args.grace)
    return 0


def _serve_models(args: argparse.Namespace, keys: tuple[str, ...], limits: Any) -> int:
    """Several models behind one URL: those of --models-dir and --models-preset."""
    from aiollama.serve_models import model_settings
    from aiollama.server.cors import Cors
    from aiollama.server.router import create_router
    from aiollama.server.run import serve as run_server

    if args.model is not None or args.model_option is not None or args.replicas > 1:
        raise ValueError("--models-dir and --models-preset serve their models: give no MODEL, and no --replicas")
    if args.models_max < 0 or (args.models_memory_mib is not None and args.models_memory_mib <= 0):
        raise ValueError("--models-max must be >= 0 and --models-memory-mib > 0")
    parser = argparse.ArgumentParser(prog="aiollama serve", add_help=False)
    add_serve(parser)
    entries, apps = model_settings(parser, args, engine_options, app_options)
    router = create_router(entries, model_options=apps, api_keys=keys, limits=limits,
                           public_metrics=args.public_metrics,
                           cors=Cors(args.cors_origins, args.cors_methods, args.cors_headers, args.cors_credentials),
                           max_loaded=args.models_max, keep_alive=args.keep_alive, autoload=args.models_autoload,
                           memory_bytes=None if args.models_memory_mib is None else args.models_memory_mib << 20)
    print(f"aiollama: {len(entries)} models ({', '.join(e.name for e in entries)}) on http://{args.host}:{args.port}",
          file=sys.stderr)
    run_server(router, host=args.host, port=args.port, log_level=args.log_level, grace=args.grace)
    return 0


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """The engine the flags describe (``EngineConfig``'s fields). Raises ValueError for flags that
    contradict each other."""
    if args.model_option is not None:
        if args.model is not None:
            raise ValueError("give the model once (a path, or -m PATH)")
        args.model = args.model_option
    if args.chat_template is not None and args.chat_template_file is not None:
        raise ValueError("give --chat-template or --chat-template-file, not both")
    options = {"n_ctx": serve_n_ctx(args), "n_seq_max": args.n_seq_max, "max_queued": args.max_queued,
               "n_batch": args.n_batch, "n_gpu_layers": args.n_gpu_layers, "n_threads": args.threads,
               "host_cache_bytes": args.host_cache_mib << 20, "checkpoint_bytes": args.checkpoint_mib << 20,
               "cache_dir": args.cache_dir, "cache_disk_bytes": int(args.cache_disk_gib * 2**30),
               "draft_tokens": args.draft_tokens, "draft_model": args.draft_model, "mtp": args.mtp,
               "deterministic": args.deterministic,
               "backend_sampling": args.backend_sampling, "overlap": args.overlap, "kv_unified": args.unified_cache,
               "cache_type_k": args.cache_type_k, "cache_type_v": args.cache_type_v, "flash_attn": args.flash_attn,
               "lora": _adapters(args.lora), "mmproj": args.mmproj,
               "chat_template": args.chat_template_file or args.chat_template, "reasoning": args.reasoning,
               "pooling": args.pooling, "n_keep": args.keep, "context_shift": args.context_shift}
    EngineConfig.from_options(args.model, **options)  # checks them now, before a server or Ray starts
    return options


def app_options(args: argparse.Namespace) -> dict[str, Any]:
    """The server around the engine, as the flags describe it (``create_app``'s options)."""
    from aiollama.server.cors import Cors

    if args.reasoning_budget is not None and args.reasoning_budget < 0:
        raise ValueError("--reasoning-budget must be >= 0")
    return {"model_name": args.model_name, "reasoning_budget": args.reasoning_budget,
            "reasoning_budget_message": args.reasoning_budget_message, "fetch_images": args.fetch_images,
            "fetch_private_addresses": args.fetch_private_addresses,
            "allowed_media_domains": tuple(args.allowed_media_domains),
            "reasoning_format": args.reasoning_format, "sampling": request_defaults(args),
            "chat_defaults": {"chat_template_kwargs": args.chat_template_kwargs,
                              "reasoning_effort": args.reasoning_effort},
            "embd_normalize": args.embd_normalize,
            "cors": Cors(args.cors_origins, args.cors_methods, args.cors_headers, args.cors_credentials),
            "props_writable": args.props, "responses_max": args.responses_max, "responses_ttl": args.responses_ttl,
            "responses_mib": args.responses_mib, "responses_db": args.responses_db}


def _adapters(given: list[str]) -> dict[str, Path]:
    """``--lora [NAME=]PATH`` options: the name defaults to the file's stem."""
    out = {}
    for item in given:
        name, sep, path = item.partition("=")
        if not sep:
            name, path = Path(item).stem, item
        out[name] = Path(path)
    return out


def _serve_replicas(args: argparse.Namespace, engine: dict[str, Any], app: dict[str, Any]) -> int:
    """Several engines on one machine (several sockets or GPUs), each a Ray Serve replica, behind
    one endpoint; Ray runs locally, bound to 127.0.0.1."""
    try:
        import ray
        from ray import serve as ray_serve

        from aiollama.ray import build_app
    except ImportError as exc:
        print(f"aiollama serve --replicas needs the ray extra: pip install 'aiollama[ray]' ({exc})", file=sys.stderr)
        return 2
    ray.init(address="local", include_dashboard=False, _node_ip_address="127.0.0.1")
    ray_serve.start(http_options={"host": args.host, "port": args.port})
    gpus = {"num_gpus": 1} if args.n_gpu_layers != 0 and _has_gpu() else {}
    n_seq_max = engine.pop("n_seq_max")
    ray_serve.run(build_app(args.model, replicas=args.replicas, n_seq_max=n_seq_max, ray_actor_options=gpus,
                            app_options=app, **engine), name="aiollama", route_prefix="/")
    print(f"aiollama: {args.replicas} replicas on http://{args.host}:{args.port} (Ctrl-C stops)", file=sys.stderr)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # a stop ends Ray's processes with this one
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        ray_serve.shutdown()  # type: ignore[no-untyped-call]
        ray.shutdown()
    return 0


def _has_gpu() -> bool:
    from aiollama import devices

    return any(d.kind in ("gpu", "igpu") for d in devices())
