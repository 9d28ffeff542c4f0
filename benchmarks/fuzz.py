"""The long fuzz run: thousands of mutated requests to every route of a running server, beside live
greedy streams, counting 5xx answers, dropped connections, answers in the wrong error shape, and
streams whose tokens differ from what they gave alone (``tests/fuzz_bodies.py`` draws the bodies).

    python benchmarks/fuzz.py --requests 5000             # serves the tiny test model itself
    python benchmarks/fuzz.py --url http://127.0.0.1:8000 --requests 5000

Without ``--url`` it starts ``aiollama serve`` on the tiny test model in deterministic mode, so
that a stream's output cannot depend on what runs beside it. Prints a summary and exits 1 on any
problem.
"""

from __future__ import annotations

import argparse
import collections
import random
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

from fuzz_bodies import ROUTES, SERVER_OPTIONS, Watch, check, mutated, send  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import seed as seeded  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default=None, help="a running server (default: start one on the tiny model)")
    parser.add_argument("--requests", type=int, default=5000, help="fuzzed requests in all, spread over the routes")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--routes", nargs="+", default=list(ROUTES), choices=list(ROUTES), help="the routes to fuzz")
    args = parser.parse_args()
    server = None
    url = args.url
    if url is None:
        from server_process import Server
        from tiny_model import tiny_model

        import aiollama

        model = tiny_model(aiollama.cache_dir() / "test-models", aiollama.pull())
        server = Server(model, *SERVER_OPTIONS)
        url = server.url

    seed = args.seed if args.seed is not None else random.randrange(2**32)
    statuses: collections.Counter[int] = collections.Counter()
    problems: list[str] = []
    per_route = max(1, args.requests // len(args.routes))

    def run_route(name: str, method: str, path: str, shape: str, bodies: list[object]) -> None:
        @seeded(seed)
        @settings(max_examples=per_route, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        @given(mutated(bodies))
        def one(body: object) -> None:
            try:
                status, raw = send(url, method, path, body)
            except OSError as exc:
                problems.append(f"{name}: dropped: {exc!r} for {body!r:.200}")
                print("  ", problems[-1], flush=True)
                return
            statuses[status] += 1
            problem = check(status, raw, shape)
            if problem is not None:
                problems.append(f"{name}: {problem} for {body!r:.3000}")
                print("  ", problems[-1], flush=True)

        one()

    start = time.monotonic()
    watch = Watch(url)
    try:
        for name in args.routes:
            method, path, shape, bodies = ROUTES[name]
            run_route(name, method, path, shape, bodies)
            print(f"{name}: {per_route} requests, {len(problems)} problems so far", flush=True)
    finally:
        watch.stop()
        if server is not None:
            server.stop()
    fives = sum(n for status, n in statuses.items() if status >= 500)
    print(f"\n{sum(statuses.values())} requests in {time.monotonic() - start:.0f} s (seed {seed}); statuses: "
          f"{dict(sorted(statuses.items()))}; 5xx: {fives}; problems: {len(problems)}; streams beside: {watch.runs} "
          f"run, {len(watch.harmed)} harmed")
    for problem in problems[:20]:
        print("  ", problem)
    for harm in watch.harmed[:5]:
        print("   harmed:", harm)
    return 1 if problems or watch.harmed or fives else 0


if __name__ == "__main__":
    sys.exit(main())
