"""A few decode steps of one model, in a process of its own: what the extra-buffer-type test runs.

    python tests/buft_logits.py MODEL OUT.npy {repack,plain}

Loads MODEL with llama.cpp's extra buffer types for weights (``repack``: repacked layouts, AMX
tiles, whatever the CPU backend offers) or without (``plain``), evaluates a 48-token prompt beside
three shorter ones, then decodes 4 steps of all four (the same tokens whatever the logits, so that
rows stay comparable); saves every logits row taken, in order, to OUT.npy, and prints the buffer
types that took weights as JSON. A kernel that crashes
kills only this process.
"""

from __future__ import annotations

import json
import logging
import random
import re
import sys

import numpy as np

from aiollama.native import Batch, Context, DecodeStatus, Model
from aiollama.native.binding import set_log_level

STEPS = 4


class _Buffers(logging.Handler):
    """Collects the buffer types llama.cpp reports weights in ("CPU_REPACK model buffer size = ...")."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        found = re.search(r"(\S+) model buffer size", record.getMessage())
        if found:
            self.names.append(found.group(1))


def main(path: str, out: str, mode: str) -> None:
    buffers = _Buffers()
    logging.getLogger("aiollama.llama_cpp").addHandler(buffers)
    logging.getLogger("aiollama.llama_cpp").setLevel(logging.INFO)
    set_log_level(logging.INFO)
    rows: list[np.ndarray] = []
    with Model(path, repack=mode == "repack") as model:
        set_log_level(logging.WARNING)
        rng = random.Random(3)
        n_vocab = model.vocab.n_tokens
        prompts = [[rng.randrange(100, n_vocab) for _ in range(n)] for n in (48, 5, 17, 30)]
        with Context(model, n_ctx=1024, n_batch=256, n_seq_max=4, n_threads=2) as ctx, Batch(256) as batch:
            batch.clear()
            last = [batch.add_tokens(p, 0, i, output_last=True) for i, p in enumerate(prompts)]
            assert ctx.decode(batch) is DecodeStatus.OK
            pos = [len(p) for p in prompts]
            for _ in range(STEPS):
                rows += [np.frombuffer(ctx.logits_buffer(r), dtype=np.float32).copy() for r in last]
                batch.clear()
                last = [batch.add_tokens([rng.randrange(100, n_vocab)], pos[i], i, output_last=True)
                        for i in range(len(prompts))]
                pos = [p + 1 for p in pos]
                assert ctx.decode(batch) is DecodeStatus.OK
    np.save(out, np.stack(rows))
    print(json.dumps({"buffers": buffers.names}), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:4])
