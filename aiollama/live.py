"""Concurrent streams shown side by side as they grow: one panel per stream and a status line with
tokens/s, the batch in use, the queue and the KV cells. ``aiollama run`` and the demo use it.

    board = Board(engine, titles)
    with board.live():
        ...                     # board.add(i, chunk.text) as chunks arrive, board.end(i, reason)
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Iterator, Sequence
from typing import Any

from rich.console import Console, ConsoleOptions, Group, RenderResult
from rich.live import Live
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from aiollama import Engine, FinishReason, SyncEngine

PANEL_WIDTH = 40  # the narrowest panel worth reading; fewer columns on a narrow terminal
TAIL = 1200  # characters of each stream kept on screen


class Board:
    """The live view of several streams of one engine (a rich renderable)."""

    def __init__(self, engine: Engine | SyncEngine, titles: Sequence[str]) -> None:
        self.engine = engine
        self.titles = list(titles)
        self.texts = [""] * len(titles)
        self.done: list[FinishReason | None] = [None] * len(titles)
        self.peak = 0
        self._start = time.perf_counter()
        self._first = engine.statistics().tokens_generated
        self._recent: deque[tuple[float, int]] = deque([(self._start, self._first)])

    def add(self, i: int, text: str) -> None:
        self.texts[i] += text
        self.peak = max(self.peak, self.engine.statistics().active)

    def end(self, i: int, reason: FinishReason | None) -> None:
        self.done[i] = reason or FinishReason.CANCELLED

    @property
    def finished(self) -> bool:
        return all(self.done)

    def rate(self) -> float:
        """Tokens/s over the last two seconds while streams run; over the whole run at the end."""
        now, generated = time.perf_counter(), self.engine.statistics().tokens_generated
        if self.finished:
            since, base = self._start, self._first
        else:
            self._recent.append((now, generated))
            while len(self._recent) > 2 and now - self._recent[1][0] > 2.0:
                self._recent.popleft()
            since, base = self._recent[0]
        return (generated - base) / max(now - since, 1e-6)

    def status(self) -> Text:
        stats = self.engine.statistics()
        self.peak = max(self.peak, stats.active)
        return Text.assemble(
            ("tokens/s ", "dim"), (f"{self.rate():6.1f}", "bold"),
            ("   batch ", "dim"), (f"{stats.active}/{stats.n_seq_max}", "bold"), (f" (peak {self.peak})", "dim"),
            ("   queued ", "dim"), (str(stats.queued), "bold"),
            ("   KV cells ", "dim"), (f"{stats.kv_cells_used - stats.kv_cells_cached}/{stats.kv_cells_total}", "bold"),
            ("   cached ", "dim"), (str(stats.kv_cells_cached), "bold"),
            ("   generated ", "dim"), (str(stats.tokens_generated), "bold"),
        )

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        columns = max(1, min(len(self.titles), options.max_width // PANEL_WIDTH))
        grid = Table.grid(expand=True)
        for _ in range(columns):
            grid.add_column(ratio=1)
        panels = [
            Panel(Text(self.texts[i][-TAIL:] or "…"), title=Text(self.titles[i][:PANEL_WIDTH], style="bold"),
                  subtitle=str(self.done[i] or "streaming"), border_style="green" if self.done[i] else "cyan")
            for i in range(len(self.titles))]
        for row in range(0, len(panels), columns):
            cells: list[Any] = panels[row:row + columns]
            grid.add_row(*cells, *[""] * (columns - len(cells)))
        yield Group(grid, self.status())

    @contextlib.contextmanager
    def live(self, console: Console | None = None) -> Iterator[Board]:
        """Redraw the board ten times a second while the block runs, and once more at its end. On a
        console that is not a terminal only that last frame is printed."""
        console = console or Console()
        with Live(self, console=console, refresh_per_second=10):
            yield self
        if not console.is_terminal:
            console.print()  # the last frame ends without a line break there
