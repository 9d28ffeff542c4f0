"""The shared shape of every native owner: idempotent close, ``with``, and a warning if leaked."""

from __future__ import annotations

import threading
import warnings
from collections import Counter
from types import TracebackType
from typing import Any

from aiollama.errors import ClosedError

_open: Counter[str] = Counter()
_open_lock = threading.Lock()


def count(kind: str, change: int) -> None:
    with _open_lock:
        _open[kind] += change


def open_handles() -> dict[str, int]:
    """How many native resources of each kind are allocated now (empty once everything is freed)."""
    with _open_lock:
        return {kind: n for kind, n in _open.items() if n}


class Handle:
    """Owns one native resource. Subclasses set ``_ptr`` and implement ``_free``.

    ``__del__`` never frees native memory: freeing from the garbage collector would run on an
    arbitrary thread, possibly while another thread uses the resource. It only warns.
    """

    _kind = "handle"
    _held: Any = None

    @property
    def _ptr(self) -> Any:
        return self._held

    @_ptr.setter
    def _ptr(self, ptr: Any) -> None:
        change = (ptr is not None) - (self._held is not None)
        if change:
            count(self._kind, change)
        self._held = ptr

    @property
    def closed(self) -> bool:
        return self._ptr is None

    def _get(self) -> Any:
        ptr = self._ptr
        if ptr is None:
            raise ClosedError(f"this {self._kind} is closed")
        return ptr

    def close(self) -> None:
        """Free the native resource. Calling it again does nothing."""
        ptr, self._ptr = self._ptr, None
        if ptr is not None:
            self._free(ptr)

    def _free(self, ptr: Any) -> None:
        raise NotImplementedError

    def __enter__(self) -> Any:
        self._get()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __del__(self) -> None:
        if getattr(self, "_ptr", None) is not None:
            warnings.warn(
                f"unclosed {self._kind} {self!r}: call close() or use 'with'",
                ResourceWarning,
                source=self,
                stacklevel=2,
            )
