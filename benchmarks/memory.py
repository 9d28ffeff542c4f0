"""The KV memory hierarchy against llama-server's prompt cache, side by side in one run.

    pip install ".[bench,server]" && python benchmarks/memory.py       # about 10 minutes on 2 cores

1. Multi-turn chat over HTTP: 8 turns, each resending the whole history (as every OpenAI client
   does), against llama-server with cache_prompt on: prompt tokens, tokens evaluated and time to
   first token per turn.
2. 32 users over 8 parallel sequences, arriving one every half second, with one shared
   1,000-token system prompt: tokens evaluated in all, and time to first token.
3. Preemption under a small context: the same 8 streams with host memory off (preempted streams
   are evaluated again) and on (they are parked and put back): wall time and tokens evaluated.

Both servers run with the same explicit thread count on 127.0.0.1; results go to
benchmarks/results/<date>-<machine>-memory.{json,md}.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

import tools  # noqa: E402
from common import machine, save_results  # noqa: E402
from server import AiollamaServer, LlamaServer  # noqa: E402

import aiollama  # noqa: E402
from aiollama.native import Model, math_cpus  # noqa: E402

SYSTEM = ("You are a patient storyteller who answers in short paragraphs. You keep track of every "
          "character and place the user mentions, and you never contradict what was said before. ")
TURNS = [
    "Begin a story about a lighthouse keeper on a rocky island.",
    "Who visits the lighthouse one stormy night?",
    "What does the visitor carry with them?",
    "The keeper is suspicious. What does she ask?",
    "The visitor answers with a riddle. What is it?",
    "How does the keeper solve the riddle?",
    "What happens when the storm ends?",
    "End the story in two sentences.",
]

# both servers share one cache among their requests (llama-server -kvu), where common prompts share cells
UNIFIED = ("--unified-cache",)


async def chat(client: httpx.AsyncClient, url: str, messages: list[dict[str, str]], max_tokens: int) -> dict[str, Any]:
    """One streamed chat request: its reply, time to first token, prompt tokens and tokens evaluated."""
    body = {"model": "m", "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "cache_prompt": True}
    start = time.perf_counter()
    first = None
    text, usage, timings = "", None, None
    async with client.stream("POST", url + "/v1/chat/completions", json=body, timeout=None) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            for choice in event.get("choices") or ():
                piece = (choice.get("delta") or {}).get("content")
                if piece:
                    first = first or time.perf_counter()
                    text += piece
            usage = event.get("usage") or usage
            timings = event.get("timings") or timings
    assert usage is not None, "no usage in the stream"
    prompt = int(usage["prompt_tokens"])
    if timings is not None:  # llama-server says what it evaluated
        evaluated = int(timings["prompt_n"])
    else:
        evaluated = prompt - int((usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0))
    return {"reply": text, "ttft_ms": 1000 * ((first or time.perf_counter()) - start), "prompt_tokens": prompt,
            "evaluated": evaluated}


async def multi_turn(url: str) -> list[dict[str, Any]]:
    messages = [{"role": "system", "content": SYSTEM * 4}]
    rows = []
    # a connection per request: llama-server may close an idle kept-alive connection just as the
    # next turn is sent on it ("Server disconnected without sending a response")
    async with httpx.AsyncClient(limits=httpx.Limits(max_keepalive_connections=0)) as client:
        for turn in TURNS:
            messages.append({"role": "user", "content": turn})
            row = await chat(client, url, messages, 48)
            messages.append({"role": "assistant", "content": row.pop("reply")})
            rows.append(row)
    return rows


async def shared_prompt(url: str, system: str, users: int) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=users + 4)) as client:
        async def user(i: int) -> None:
            await anyio.sleep(0.5 * i)
            messages = [{"role": "system", "content": system},
                        {"role": "user", "content": f"I am user number {i}. {TURNS[i % len(TURNS)]}"}]
            row = await chat(client, url, messages, 32)
            row.pop("reply")
            rows.append(row)

        async with anyio.create_task_group() as tg:
            for i in range(users):
                tg.start_soon(user, i)
    return {"users": users, "prompt_tokens": sum(r["prompt_tokens"] for r in rows),
            "evaluated": sum(r["evaluated"] for r in rows),
            "ttft_median_ms": statistics.median(r["ttft_ms"] for r in rows),
            "ttft_max_ms": max(r["ttft_ms"] for r in rows)}


async def preemption(model: Path, threads: int, host_cache_bytes: int) -> dict[str, Any]:
    prompts = [f"Story {i}: " + " ".join(["a long and winding road through the hills"] * 20) for i in range(8)]
    async with aiollama.Engine(model, n_ctx=1536, n_seq_max=8, n_threads=threads,
                               host_cache_bytes=host_cache_bytes) as engine:
        start = time.perf_counter()
        async def one(p: str) -> None:
            async with engine.conversation(p) as conv:
                await conv.stream(max_tokens=160, temperature=0, ignore_eos=True)

        async with anyio.create_task_group() as tg:
            for p in prompts:
                tg.start_soon(one, p)
        s = engine.statistics()
        return {"host_cache_bytes": host_cache_bytes, "seconds": time.perf_counter() - start,
                "tokens_evaluated": s.tokens_evaluated, "tokens_generated": s.tokens_generated,
                "preemptions": s.preemptions, "parks": s.parks, "restores": s.restores}


def markdown(r: dict[str, Any]) -> str:
    out = [f"Measured {r['date']} on {r['machine']['cpu']} ({r['machine']['cpus']} CPUs), llama.cpp {tools.TAG}, "
           f"{r['model']}, {r['threads']} threads for both servers.", "",
           "**1. Multi-turn chat over HTTP** (8 turns, each resending the whole history; max 48 new tokens)", "",
           "| turn | aiollama prompt | aiollama evaluated | aiollama TTFT (ms) | llama-server prompt | "
           "llama-server evaluated | llama-server TTFT (ms) |", "|---:|---:|---:|---:|---:|---:|---:|"]
    for i, (a, b) in enumerate(zip(r["multi_turn"]["aiollama"], r["multi_turn"]["llama_server"]), 1):
        out.append(f"| {i} | {a['prompt_tokens']} | {a['evaluated']} | {a['ttft_ms']:.0f} | {b['prompt_tokens']} | "
                   f"{b['evaluated']} | {b['ttft_ms']:.0f} |")
    sp = r["shared_prompt"]
    out += ["", f"**2. Shared system prompt** ({sp['aiollama']['users']} users over 8 parallel sequences, one every "
            f"0.5 s, a {sp['system_tokens']}-token system prompt)", "",
            "| | prompt tokens | evaluated | TTFT median (ms) | TTFT max (ms) |", "|---|---:|---:|---:|---:|"]
    for name in ("aiollama", "llama_server"):
        row = sp[name]
        out.append(f"| {name} | {row['prompt_tokens']} | {row['evaluated']} | {row['ttft_median_ms']:.0f} | "
                   f"{row['ttft_max_ms']:.0f} |")
    out += ["", "**3. Preemption under a small context** (8 streams of ~200 + 160 tokens in 1,536 cells)", "",
            "| host memory | seconds | tokens evaluated | preemptions | parks | restores |",
            "|---|---:|---:|---:|---:|---:|"]
    for row in r["preemption"]:
        name = "off (evaluated again)" if not row["host_cache_bytes"] else "on (parked, put back)"
        out.append(f"| {name} | {row['seconds']:.1f} | {row['tokens_evaluated']} | {row['preemptions']} | "
                   f"{row['parks']} | {row['restores']} |")
    return "\n".join(out) + "\n"


async def main(args: argparse.Namespace) -> int:
    model = Path(args.model) if args.model else aiollama.default_model()
    threads = args.threads or math_cpus()
    bins = tools.build(quiet=True)
    system = SYSTEM * 28
    r: dict[str, Any] = {"date": datetime.date.today().isoformat(), "machine": machine(), "model": model.name,
                         "threads": threads, "llama_cpp": tools.TAG}
    print("1. multi-turn chat", flush=True)
    with AiollamaServer(model, n_seq_max=8, n_ctx=8192, threads=threads, extra=UNIFIED) as ours:
        mine = await multi_turn(ours.url)
    with LlamaServer(bins["llama-server"], model, n_parallel=8, n_ctx=8192, threads=threads) as theirs:
        other = await multi_turn(theirs.url)
    r["multi_turn"] = {"aiollama": mine, "llama_server": other}
    print("2. shared system prompt", flush=True)
    with AiollamaServer(model, n_seq_max=8, n_ctx=16384, threads=threads, extra=UNIFIED) as ours:
        mine_sp = await shared_prompt(ours.url, system, args.users)
    with LlamaServer(bins["llama-server"], model, n_parallel=8, n_ctx=16384, threads=threads) as theirs:
        other_sp = await shared_prompt(theirs.url, system, args.users)
    with Model(model, vocab_only=True) as m:
        n_system = len(m.vocab.tokenize(system))
    r["shared_prompt"] = {"system_tokens": n_system, "aiollama": mine_sp, "llama_server": other_sp}
    print("3. preemption", flush=True)
    r["preemption"] = [await preemption(model, threads, 0), await preemption(model, threads, 2 << 30)]
    save_results(r, "memory", markdown(r))
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="GGUF model (default: SmolLM2-135M-Instruct Q4_1)")
    parser.add_argument("--threads", type=int, help="threads for both servers (default: one per physical core)")
    parser.add_argument("--users", type=int, default=32)
    sys.exit(anyio.run(main, parser.parse_args()))
