"""``aiollama serve``'s flags named as llama-server's, so that its command lines and scripts carry
over: the defaults of requests that give none (``--temp``, ``--top-k``, ``-n``, ``--grammar``...),
the embeddings' ``--pooling``, CORS (``--cors-origins``...), the flags of what is always on here
(``--embeddings``, ``--jinja``, ``--metrics``), accepted; and each of llama-server's other flags,
refused with the reason. docs/llama-server.md has the table."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any, NoReturn

from aiollama.config import POOLING_TYPES

# the stream parameters that flags set for requests that give none: (flags, parameter, type, help)
SAMPLING: tuple[tuple[tuple[str, ...], str, type, str], ...] = (
    (("--temp", "--temperature"), "temperature", float, "the sampling temperature (default: 0.8)"),
    (("--top-k",), "top_k", int, "top-k (default: 40)"), (("--top-p",), "top_p", float, "top-p (default: 0.95)"),
    (("--min-p",), "min_p", float, "min-p (default: 0.05)"),
    (("--typical", "--typical-p"), "typical_p", float, "typical-p (default: 1, off)"),
    (("--repeat-penalty",), "repeat_penalty", float, "the repeat penalty (default: 1, off)"),
    (("--repeat-last-n",), "penalty_last_n", int, "the tokens the penalties look back on (default: 64)"),
    (("--presence-penalty",), "presence_penalty", float, "the presence penalty (default: 0)"),
    (("--frequency-penalty",), "frequency_penalty", float, "the frequency penalty (default: 0)"),
    (("-s", "--seed"), "seed", int, "the seed (default: -1, random)"),
    (("-n", "--n-predict", "--predict"), "max_tokens", int, "the length limit in tokens (default: -1, none)"),
)

# llama-server's flags that aiollama does not take, each group with why; every other one it takes
REFUSED: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("threads and CPU placement are the engine's: give -t", (
        "-tb", "--threads-batch", "-C", "--cpu-mask", "-Cr", "--cpu-range", "--prio", "--poll", "-Cb",
        "--cpu-mask-batch", "-Crb", "--cpu-range-batch", "--prio-batch", "--numa", "--cpu-strict",
        "--cpu-strict-batch", "--poll-batch")),
    ("where weights and cache go is llama.cpp's fitting of -ngl, on the devices it finds", (
        "-kvo", "--kv-offload", "-nkvo", "--no-kv-offload", "--repack", "-nr", "--no-repack", "--no-host", "--rpc",
        "-dev", "--device", "--list-devices", "-ot", "--override-tensor", "-cmoe", "--cpu-moe", "-ncmoe",
        "--n-cpu-moe", "-ncffn", "--n-cpu-ffn", "-sm", "--split-mode", "-ts", "--tensor-split", "-mg", "--main-gpu",
        "-fitt", "--fit-target", "-fitc", "--fit-ctx", "--op-offload", "--no-op-offload", "-lm", "--load-mode",
        "-lzm", "--lazy-mode", "--check-tensors", "-ub", "--ubatch-size", "-fit", "--fit")),
    ("the model's RoPE scaling and metadata are read from its GGUF as they are", (
        "--rope-scaling", "--rope-scale", "--rope-freq-base", "--rope-freq-scale", "--yarn-orig-ctx",
        "--yarn-ext-factor", "--yarn-attn-factor", "--yarn-beta-slow", "--yarn-beta-fast", "--override-kv")),
    ("that sampler is not in aiollama's chain (penalties, top-k, typical, top-p, min-p, temperature)", (
        "--top-nsigma", "--top-n-sigma", "--xtc-probability", "--xtc-threshold", "--dry-multiplier", "--dry-base",
        "--dry-allowed-length", "--dry-penalty-last-n", "--dry-sequence-breaker", "--adaptive-target",
        "--adaptive-decay", "--dynatemp-range", "--dynatemp-exp", "--mirostat", "--mirostat-lr", "--mirostat-ent")),
    ("the samplers' order is fixed; a request's 'samplers' may name a subset of them", (
        "--samplers", "--sampler-seq", "--sampling-seq")),
    ("models are local GGUF files ('aiollama pull' fetches the default one)", (
        "-mu", "--model-url", "-dr", "--docker-repo", "-hf", "-hfr", "--hf-repo", "-hff", "--hf-file", "-hft",
        "--hf-token", "--offline", "-mmu", "--mmproj-url", "--spec-draft-hf", "-hfd", "-hfrd", "--hf-repo-draft",
        "-cl", "--cache-list")),
    ("presets name models to download: give the model file and the flags", (
        "--embd-gemma-default", "--fim-qwen-1.5b-default", "--fim-qwen-3b-default", "--fim-qwen-7b-default",
        "--fim-qwen-7b-spec", "--fim-qwen-14b-spec", "--fim-qwen-30b-default", "--gpt-oss-20b-default",
        "--gpt-oss-120b-default", "--vision-gemma-4b-default", "--vision-gemma-12b-default", "--spec-default")),
    ("logs are uvicorn's: give --log-level", (
        "--log-file", "--log-jsonl", "--no-log-jsonl", "-lv", "--verbosity", "--log-verbosity", "--log-prefix",
        "--no-log-prefix", "--log-timestamps", "--no-log-timestamps", "--perf", "--no-perf", "--log-prompts-dir",
        "--log-colors")),
    ("control vectors are not supported", ("--control-vector", "--control-vector-scaled",
                                            "--control-vector-layer-range")),
    ("adapters are loaded with --lora NAME=PATH and each request gives its scale", (
        "--lora-scaled", "--lora-init-without-apply")),
    ("speculation is --draft-tokens, with n-grams, a --draft-model or --mtp; its tuning is the engine's", (
        "--spec-draft-type-k", "-ctkd", "--cache-type-k-draft", "--spec-draft-type-v", "-ctvd", "--cache-type-v-draft",
        "--spec-draft-threads", "-td", "--threads-draft", "--spec-draft-threads-batch", "-tbd",
        "--threads-batch-draft", "--spec-draft-cpu-mask", "-Cd", "--cpu-mask-draft", "--spec-draft-cpu-range",
        "-Crd", "--cpu-range-draft", "--spec-draft-prio", "--prio-draft", "--spec-draft-cpu-mask-batch", "-Cbd",
        "--cpu-mask-batch-draft", "--spec-draft-prio-batch", "--prio-batch-draft", "--spec-draft-override-tensor",
        "-otd", "--override-tensor-draft", "--spec-draft-cpu-moe", "-cmoed", "--cpu-moe-draft",
        "--spec-draft-n-cpu-moe", "--spec-draft-ncmoe", "-ncmoed", "--n-cpu-moe-draft", "--spec-draft-n-max",
        "--spec-draft-n-min", "--spec-synth-len", "--spec-synth-rates", "--spec-draft-p-split", "--draft-p-split",
        "--spec-draft-p-min", "--draft-p-min", "--spec-draft-backend-sampling", "--no-spec-draft-backend-sampling",
        "--spec-draft-device", "-devd", "--device-draft", "--spec-draft-ngl", "-ngld", "--gpu-layers-draft",
        "--spec-draft-cpu-strict", "--cpu-strict-draft", "--spec-draft-poll", "--poll-draft",
        "--spec-draft-cpu-strict-batch", "--cpu-strict-batch-draft", "--spec-draft-poll-batch", "--poll-batch-draft",
        "--n-gpu-layers-draft", "--spec-type", "--spec-ngram-mod-n-min", "--spec-ngram-mod-n-max",
        "--spec-ngram-mod-n-match", "--spec-ngram-simple-size-n", "--spec-ngram-simple-size-m",
        "--spec-ngram-simple-min-hits", "--spec-ngram-map-k-size-n", "--spec-ngram-map-k-size-m",
        "--spec-ngram-map-k-min-hits", "--spec-ngram-map-k4v-size-n", "--spec-ngram-map-k4v-size-m",
        "--spec-ngram-map-k4v-min-hits", "--draft-min", "--draft-n-min", "--spec-ngram-size-n",
        "--spec-ngram-size-m", "--spec-ngram-min-hits", "-lcs", "--lookup-cache-static", "-lcd",
        "--lookup-cache-dynamic")),
    (("the engine manages its cache: split or unified (-kvu), parked states in host memory (--cache-ram), "
      "checkpoints of recurrent states (--checkpoint-mib)"), (
        "--swa-full", "-dt", "--defrag-thold", "--kv-unified-per-slot", "-ctxcp", "--ctx-checkpoints",
        "--swa-checkpoints", "-cms", "--checkpoint-min-step", "--cache-idle-slots", "--no-cache-idle-slots",
        "--cache-reuse", "-sps", "--slot-prompt-similarity")),
    ("every prompt's prefix is cached and shared; a request's cache_prompt false or cache_salt keeps it apart", (
        "--cache-prompt", "--no-cache-prompt")),
    ("continuous batching is how the engine runs", ("-nocb", "--no-cont-batching")),
    ("there are no slot endpoints: every request is a conversation, and conversations are saved by the library; "
     "`--cache-dir` keeps cached prefixes on disk across restarts, without a call", ("--slots", "--slot-save-path")),
    ("there is no web UI", (
        "--ui", "--webui", "--ui-config", "--webui-config", "--ui-config-file", "--webui-config-file",
        "--ui-mcp-proxy", "--webui-mcp-proxy", "--no-ui-mcp-proxy", "--no-webui-mcp-proxy", "--media-path")),
    ("server tools, MCP servers and agents are not served", (
        "--tools", "--tools-runtime", "--mcp-servers-config", "--mcp-servers-json", "-ag", "--agent", "-no-ag",
        "--no-agent")),
    ("TLS is a proxy's: run the server behind one", ("--ssl-key-file", "--ssl-cert-file")),
    ("the HTTP server is uvicorn, on one event loop, at the root path", (
        "--threads-http", "--reuse-port", "--path", "--api-prefix", "-to", "--timeout", "--sse-ping-interval")),
    ("the image projector is loaded as given (--mmproj), where the model is, with its own token counts", (
        "--mmproj-auto", "--no-mmproj", "--no-mmproj-auto", "--mmproj-offload", "--no-mmproj-offload", "-mmdev",
        "--mmproj-device", "--image-min-tokens", "--image-max-tokens", "--mtmd-batch-max-tokens", "--video-fps",
        "--video-timestamp-interval", "--video-ffmpeg-dir")),
    ("templates are always Jinja, rendered by llama.cpp", ("--no-jinja",)),
    ("replies are always read by the model's chat parser (reasoning_format none keeps thinking in the content)", (
        "--skip-chat-parsing", "--no-skip-chat-parsing")),
    ("a final assistant message is continued unless the request says continue_final_message false", (
        "--prefill-assistant", "--no-prefill-assistant")),
    ("past turns' reasoning is rendered as each template renders it", (
        "--reasoning-preserve", "--no-reasoning-preserve")),
    ("special tokens are parsed in prompt text where the API says so, and kept out of replies", ("-sp", "--special")),
    ("the model warms up with its first request", ("--warmup", "--no-warmup")),
    ("suffix-prefix-middle infill is not built; /infill uses prefix-suffix-middle", ("--spm-infill",)),
    ("model tags are not served", ("--tags",)),
    ("the server does not sleep: a loaded model stays", ("--sleep-idle-seconds",)),
    ("flag values are taken as they are, without escapes", ("-e", "--escape", "--no-escape")),
    ("shell completion is not generated", ("--completion-bash",)),
)


class _Refused(argparse.Action):
    """A llama-server flag that aiollama does not take: the parse ends with the reason."""

    def __init__(self, option_strings: list[str], dest: str, reason: str = "", **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs="?", help=argparse.SUPPRESS, **kwargs)
        self.reason = reason

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> NoReturn:
        parser.error(f"{option_string} is llama-server's and not taken here: {self.reason}")


def llama_server_flags(serve: argparse.ArgumentParser) -> None:
    """llama-server's own flags: those of features aiollama has, and the others refused."""
    group = serve.add_argument_group("llama-server's flags: defaults of requests that give none")
    for flags, name, kind, what in SAMPLING:
        group.add_argument(*flags, dest="default_" + name, type=kind, default=None,
                           metavar="X" if kind is float else "N", help=what)
    group.add_argument("--ignore-eos", action="store_true", help="generate past the end-of-generation token")
    group.add_argument("-r", "--reverse-prompt", action="append", default=[], metavar="TEXT",
                       help="a stop string (repeat for several)")
    group.add_argument("-l", "--logit-bias", action="append", default=[], type=_bias, metavar="TOKEN_ID(+/-)BIAS",
                       help="a token's logit bias, as 15043+1 or 15043-inf (repeat for several)")
    group.add_argument("--grammar", default=None, help="a GBNF grammar the output follows")
    group.add_argument("--grammar-file", type=Path, default=None, help="the same, from a file")
    group.add_argument("-j", "--json-schema", type=_object, default=None, metavar="SCHEMA",
                       help="a JSON schema the output follows")
    group.add_argument("-jf", "--json-schema-file", type=Path, default=None, help="the same, from a file")
    group.add_argument("--chat-template-kwargs", type=_object, default=None, metavar="JSON",
                       help="variables for the chat template, as a JSON object")
    group.add_argument("--reasoning-effort", default=None, metavar="LEVEL", help="the reasoning effort of chat requests")
    group.add_argument("--embd-normalize", type=int, default=2, metavar="N",
                       help="how /embedding normalises: -1 none, 0 max-abs, 1 taxicab, 2 euclidean, p > 2 p-norm")
    other = serve.add_argument_group("llama-server's flags: the server")
    other.add_argument("--pooling", choices=POOLING_TYPES, default=None,
                       help="how embeddings pool a text's hidden states (default: the model's own; mean for a "
                            "generative model); none: a vector per token, on /embedding; rank: a reranker's scores")
    other.add_argument("--rerank", "--reranking", dest="pooling", action="store_const", const="rank",
                       help="serve /rerank with a reranker that does not say so itself (--pooling rank)")
    models = serve.add_argument_group("several models behind one URL (llama-server's router mode)")
    models.add_argument("--models-dir", type=Path, default=None, metavar="DIR",
                        help="serve each *.gguf of DIR (and each subfolder holding one), named by its file's stem; "
                             "a request's 'model' chooses")
    models.add_argument("--models-preset", type=Path, default=None, metavar="INI",
                        help="models and their flags, as llama-server's INI presets ([name], model = PATH, flags "
                             "without dashes, alias, load-on-startup, keep-alive; [*] for all)")
    models.add_argument("--models-max", type=int, default=4, metavar="N",
                        help="models loaded at once (0: no limit); the least recently used idle one makes room")
    models.add_argument("--models-autoload", action=argparse.BooleanOptionalAction, default=True,
                        help="load a model on its first request (default: on); off: /models/load first")
    models.add_argument("--models-memory-mib", type=int, default=None, metavar="MIB",
                        help="memory the loaded models may take together (weights and KV cells); none by default")
    models.add_argument("--keep-alive", type=float, default=300.0, metavar="SECONDS",
                        help="how long an idle model stays loaded (negative: forever; a request's keep_alive "
                             "sets it for its model)")
    other.add_argument("--cors-origins", "--allowed-origins", default="localhost",
                       help="web pages that may call the server: localhost (pages served from this machine, the "
                            "default), * (any), or a comma-separated list of origins")
    other.add_argument("--cors-methods", default="GET, POST, DELETE, OPTIONS", help="methods a preflight allows")
    other.add_argument("--cors-headers", default="*", help="headers a preflight allows")
    other.add_argument("--cors-credentials", action=argparse.BooleanOptionalAction, default=True,
                       help="credentials (keys, cookies) may go along (default: on)")
    other.add_argument("--props", action="store_true", help="POST /props answers (it changes nothing)")
    other.add_argument("--usage", action="help", help="the same as --help")
    other.add_argument("-v", "--verbose", "--log-verbose", dest="log_level", action="store_const", const="debug",
                       help="log everything (--log-level debug)")
    other.add_argument("--log-disable", dest="log_level", action="store_const", const="critical",
                       help="log nothing but failures")
    for flags, what in ((("--embedding", "--embeddings"), "embeddings are always served"),
                        (("--jinja",), "chat templates are always Jinja"), (("--metrics",), "/metrics is always served"),
                        (("--no-ui", "--no-webui"), "there is no web UI"), (("--no-slots",), "there are no slots"),
                        (("-cb", "--cont-batching"), "batching is always continuous")):
        other.add_argument(*flags, dest="accepted_" + flags[-1].lstrip("-").replace("-", "_"), action="store_true",
                           help=f"accepted: {what}")
    for reason, names in REFUSED:
        taken = [n for n in names if n not in serve._option_string_actions]
        if taken:
            serve.add_argument(*taken, dest=argparse.SUPPRESS, action=_Refused, reason=reason)


def _bias(text: str) -> tuple[int, float]:
    match = re.fullmatch(r"(\d+)([+-].+)", text)
    if match is None:
        raise argparse.ArgumentTypeError(f"TOKEN_ID(+/-)BIAS, as 15043+1, not {text!r}")
    try:
        return int(match.group(1)), float(match.group(2))
    except ValueError:
        raise argparse.ArgumentTypeError(f"TOKEN_ID(+/-)BIAS, as 15043+1, not {text!r}") from None


def _object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a JSON object, not {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"a JSON object, not {text!r}")
    return value


def request_defaults(args: argparse.Namespace) -> dict[str, Any]:
    """The stream parameters that the flags set for requests that give none."""
    out: dict[str, Any] = {}
    for _, name, _, _ in SAMPLING:
        value = getattr(args, "default_" + name, None)
        if value is None or (name == "seed" and value == -1):  # -1: llama-server's random seed, the default
            continue
        out[name] = (None if value < 0 else max(1, value)) if name == "max_tokens" else value
    if args.ignore_eos:
        out["ignore_eos"] = True
    if args.reverse_prompt:
        out["stop"] = list(args.reverse_prompt)
    if args.logit_bias:
        out["logit_bias"] = dict(args.logit_bias)
    grammar = args.grammar_file.read_text(encoding="utf-8") if args.grammar_file else args.grammar
    schema = json.loads(args.json_schema_file.read_text(encoding="utf-8")) if args.json_schema_file \
        else args.json_schema
    if grammar is not None and schema is not None:
        raise ValueError("give a grammar or a JSON schema, not both")
    if grammar is not None:
        out["grammar"] = grammar
    if schema is not None:
        out["json_schema"] = schema
    return out
