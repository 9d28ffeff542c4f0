"""The prefix cache's rules for a recurrent or hybrid model. Pure Python.

A holder's recurrent state is the state after its last position (see
:mod:`aiollama.sched.checkpoints`), so :class:`RecurrentKV` changes three of
:class:`~aiollama.sched.kvcache.KVManager`'s rules: a holder is shared only whole, or up to a
checkpoint put back after the copy; dropping the end of a holder goes back to the latest checkpoint
at or before the kept length (or to nothing); and after a failed or aborted decode, whose recurrent
state may be half computed, to a checkpoint as well. Everything else (seq ids, cells, parking whole
states, eviction) is the same.
"""

from __future__ import annotations

from collections.abc import Sequence

from aiollama.sched.checkpoints import CheckpointStore, Saved
from aiollama.sched.hostcache import HostCache
from aiollama.sched.kvcache import KVManager
from aiollama.sched.sequence import SeqState
from aiollama.sched.step import Checkpoint, Remove, Restore


class RecurrentKV(KVManager):
    """:class:`~aiollama.sched.kvcache.KVManager` for a hybrid model's memory (KV cells and a
    recurrent state per sequence) or, with ``cells_held`` False, a purely recurrent one's."""

    def __init__(self, n_cells: int, n_seq_max: int, host: HostCache | None = None, *,
                 checkpoints: CheckpointStore, cells_held: bool = True) -> None:
        super().__init__(n_cells, n_seq_max, host)
        self.checkpoints = checkpoints
        self.cells_held = cells_held

    def clear_cache(self) -> None:
        """Drop every cache entry, every parked state and every checkpoint."""
        super().clear_cache()
        self.checkpoints.clear()

    def truncate(self, seq: SeqState, keep: int) -> None:
        """Keep as many of the first ``keep`` cached positions of ``seq`` as the latest checkpoint
        at or before ``keep`` gives back."""
        if seq.seq_id is not None and 0 < keep < seq.n_cached:
            self.rollback(seq, keep)
        else:
            super().truncate(seq, keep)

    def resync(self, seq: SeqState, n_cached: int) -> None:
        """After an aborted or failed decode: back to a checkpoint, whatever the context holds."""
        if seq.seq_id is not None:
            self.rollback(seq, seq.n_cached)

    def rollback(self, seq: SeqState, keep: int) -> None:
        """``seq`` goes back to the latest checkpoint of its tokens at or before ``keep``
        (its state put back, its later cells removed), or to nothing. Also after a failed decode,
        when what the context holds of it is unknown: the operations do not depend on it."""
        assert seq.seq_id is not None
        saved = self.checkpoints.deepest(seq.tokens, keep, seq.salt)
        n = 0 if saved is None else saved.n
        if saved is not None:
            assert saved.data is not None
            self.checkpoints.touch(saved, self.tick())
            self._ops.append(Restore(seq.seq_id, saved.data, partial=True))
        self._ops.append(Remove(seq.seq_id, n))
        used = self.cells.used
        self._set_tail(seq, self.cells.truncate(seq.kv, n))
        self._released(used)

    def checkpoint(self, seq: SeqState) -> None:
        """Copy ``seq``'s state out at its current end (the bytes come with the next
        step's result), unless one of the same tokens is kept already."""
        assert seq.seq_id is not None
        seq.checkpoint_at = seq.n_cached
        key = self.checkpoints.reserve(seq.tokens[:seq.n_cached], self.tick(), seq.salt)
        if key is not None:
            self._ops.append(Checkpoint(seq.seq_id, key))

    def find_state(self, tokens: Sequence[int], limit: int,
                   salt: str | None = None) -> tuple[SeqState | None, int, Saved | None]:
        """How much of ``tokens`` (at most ``limit``) a new sequence can start with, as
        ``(donor, n, checkpoint)``: a holder of exactly the first ``n`` tokens (its whole state is
        shared), or a checkpoint after ``n`` tokens with a holder of their cells (a hybrid's) or none
        (a purely recurrent model has no cells)."""
        span, m = self.cells.find(tokens, limit, salt)
        whole: SeqState | None = None
        whole_n = 0
        s = span
        while s is not None and whole is None:
            if s.end <= m and self._tails.get(s):
                whole, whole_n = next(iter(self._tails[s])), s.end
            s = s.parent
        saved = self.checkpoints.deepest(tokens, limit, salt)
        if saved is not None and saved.n > whole_n:
            if not self.cells_held:
                return None, saved.n, saved
            if saved.n <= m:
                donor, _ = self.find(tokens, saved.n, salt)
                return donor, saved.n, saved
        return whole, whole_n, None

    def share_state(self, seq: SeqState, donor: SeqState | None, n: int, saved: Saved | None) -> None:
        """``seq`` starts with what :meth:`find_state` found."""
        assert seq.seq_id is not None
        if donor is not None:
            self.share(seq, donor, n)
        elif seq.kv is not None:
            self._remove_all(seq)
            self._set_tail(seq, None)
        if saved is not None:
            assert saved.data is not None and saved.n == n
            self.checkpoints.touch(saved, self.tick())
            self._ops.append(Restore(seq.seq_id, saved.data, partial=True))
            if donor is None:
                self._set_tail(seq, self.cells.extend(None, saved.tokens, seq.salt))
        seq.checkpoint_at = n
