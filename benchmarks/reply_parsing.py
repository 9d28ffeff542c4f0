"""What reading a streamed chat reply costs the server, as the reply grows: spliced (aiollama's
reader, :mod:`aiollama.formats.splice`) against the whole text parsed at every chunk (llama-server's
way, the reader before it), same run, same parser.

    pip install ".[bench]" && python benchmarks/reply_parsing.py            # about a minute

Each reply is fed a token's worth of text at a time (4 characters) through llama.cpp's parser of a
vendor template's format: a thinking model's reasoning then its answer (Qwen3), a plain answer
(Qwen2.5), and an answer then a tool call (Qwen3 with tools). For each, the time per
thousand tokens in each quarter of the reply: flat when the cost is linear in the reply's length,
growing with it when quadratic.
"""

from __future__ import annotations

import argparse
import datetime
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))

from chat_cases import llama_cpp_dir  # noqa: E402
from common import machine, save_results  # noqa: E402

from aiollama.formats.chat import ChatTemplate  # noqa: E402
from aiollama.formats.messages import normalize  # noqa: E402
from aiollama.formats.reply import ReplyReader  # noqa: E402
from aiollama.native.chat import ChatTemplates  # noqa: E402

WORDS = "the model writes a long answer about many things and keeps going with more of them".split()
TOOL = {"type": "function", "function": {"name": "write", "description": "Write a file",
                                         "parameters": {"type": "object", "properties": {"text": {"type": "string"}}}}}


def words(n_chars: int, seed: int) -> str:
    out, i = [], seed
    while sum(map(len, out)) + len(out) < n_chars:
        out.append(WORDS[i % len(WORDS)])
        i += 7
    return " ".join(out)


def cases(tokens: int) -> dict[str, tuple[str, list[dict[str, Any]] | None, str]]:
    n = tokens * 4
    return {
        "qwen3 reasoning then answer": ("Qwen-Qwen3-0.6B.jinja", None,
                                        f"<think>\n{words(n // 2, 1)}\n</think>\n\n{words(n // 2, 2)}"),
        "plain answer (Qwen2.5)": ("Qwen-Qwen2.5-7B-Instruct.jinja", None, words(n, 3)),
        "qwen3 answer then a tool call": ("Qwen-Qwen3-0.6B.jinja", [TOOL],
                                          f"<think>\nok\n</think>\n\n{words(n - 200, 4)}\n<tool_call>\n"
                                          '{"name": "write", "arguments": {"text": "short"}}\n</tool_call>'),
    }


def run(template: str, tools: list[dict[str, Any]] | None, text: str, splice: bool) -> list[float]:
    """Seconds spent feeding each quarter of the reply."""
    chat = ChatTemplate(ChatTemplates((llama_cpp_dir() / "models" / "templates" / template).read_text()))
    reader = ReplyReader(chat.parser(chat.render(normalize("Hi"), tools=tools)), splice=splice)
    pieces = [text[i:i + 4] for i in range(0, len(text), 4)]
    quarter = len(pieces) // 4
    out = []
    for q in range(4):
        start = time.perf_counter()
        for piece in pieces[q * quarter:(q + 1) * quarter if q < 3 else len(pieces)]:
            reader.feed(piece)
        out.append(time.perf_counter() - start)
    start = time.perf_counter()
    reader.finish()
    out[-1] += time.perf_counter() - start
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=4000)
    parser.add_argument("--tag", default="", help="a suffix for the results' file names")
    args = parser.parse_args()
    results: dict[str, Any] = {"date": datetime.date.today().isoformat(), "machine": machine(),
                               "tokens": args.tokens, "cases": {}}
    lines = [f"# Reading a streamed reply of {args.tokens} tokens: ms per 1,000 tokens, by quarter", "",
             "| reply | reader | q1 | q2 | q3 | q4 | total ms | q4 / q1 |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    for name, (template, tools, text) in cases(args.tokens).items():
        for splice in (False, True):
            quarters = run(template, tools, text, splice)
            per_k = [1000 * q / (args.tokens / 4 / 1000) for q in quarters]
            who = "spliced (aiollama)" if splice else "whole text each chunk"
            results["cases"].setdefault(name, {})[who] = {"seconds_by_quarter": quarters, "total": sum(quarters)}
            lines.append(f"| {name} | {who} | " + " | ".join(f"{v:.1f}" for v in per_k) +
                         f" | {1000 * sum(quarters):.0f} | {per_k[3] / per_k[0]:.2f} |")
    save_results(results, "reply-parsing" + (f"-{args.tag}" if args.tag else ""), "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
