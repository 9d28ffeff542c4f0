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
    """Owns one native resource. Subclasses hand it to ``_own`` and implement ``_free``.

    ``__del__`` never frees native memory: freeing from the garbage collector would run on an
    arbitrary thread, possibly while another thread uses the resource. It only warns.
    """

    _kind = "handle"
    _ptr: Any = None

    def _own(self, ptr: Any) -> None:
        """Take ownership of a freshly allocated native resource (counted in ``open_handles``)."""
        self._ptr = ptr
        count(self._kind, 1)

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
            count(self._kind, -1)
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
