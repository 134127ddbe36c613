"""Identity labels (external id, name) for search answers: read from the database once, then remembered.

The change log says when a remembered label may be wrong: an identity's faces removed (possibly with the
identity), a relabel (rename, merge), a dropped collection. A read that began before such a change was
applied is not remembered (a generation counter), so a replica shows a rename as soon as it has applied
the log, as it does an enrolment.
"""

from __future__ import annotations

import threading
from collections.abc import Set as AbstractSet

from gallery.store.models import ChangeOp
from gallery.store.store import Change, GalleryStore

#: Identity labels remembered at most; past it the memory starts again empty.
MAX_LABELS = 100_000

Label = tuple[str, str]


class Labels:
    """Thread-safe: a lock of its own, never held while the database is read."""

    def __init__(self, store: GalleryStore) -> None:
        self._store = store
        self._known: dict[int, Label] = {}
        self._generation = 0
        self._lock = threading.Lock()

    def __contains__(self, identity_id: object) -> bool:
        return identity_id in self._known

    def __len__(self) -> int:
        return len(self._known)

    def forget(self, changes: list[Change]) -> None:
        """Forget the labels these changes may have made wrong: the identity's (faces removed, possibly
        with it, or a relabel), every one on a dropped collection."""
        stale = {c.identity_id for c in changes if c.op in (ChangeOp.REMOVE, ChangeOp.RELABEL)}
        dropped = any(c.op is ChangeOp.DROP for c in changes)
        if not stale and not dropped:
            return
        with self._lock:
            if dropped:
                self._known.clear()
            for identity in stale:
                self._known.pop(identity, None)
            self._generation += 1  # a read begun before these changes may hold what they replaced

    def of(self, identity_ids: AbstractSet[int]) -> dict[int, Label]:
        """(external_id, name) of these identities: remembered ones, the rest from the database (an
        identity deleted there is left out)."""
        with self._lock:
            known = {i: self._known[i] for i in identity_ids if i in self._known}
            generation = self._generation
        missing = identity_ids - known.keys()
        if missing:
            read = self._store.identity_labels(missing)
            with self._lock:
                if generation == self._generation:  # no change to labels applied meanwhile
                    if len(self._known) + len(read) > MAX_LABELS:
                        self._known.clear()
                    self._known.update(read)
            known.update(read)
        return known

    def remembered(self, identity_ids: AbstractSet[int]) -> dict[int, Label] | None:
        """The labels of these identities if every one is remembered and the lock is free at once (the
        inline search on the event loop must not wait), else None."""
        if not self._lock.acquire(blocking=False):
            return None
        try:
            if not identity_ids <= self._known.keys():
                return None
            return {i: self._known[i] for i in identity_ids}
        finally:
            self._lock.release()
