"""Identity labels (external id, name) for search answers: read from the database once, then remembered.

The change log says when a remembered label may be wrong: an identity's faces removed (possibly with the
identity), a relabel (rename, merge), a dropped collection. A read that began before such a change was
applied is not remembered (a generation counter), so a replica shows a rename as soon as it has applied
the log, as it does an enrolment.

The replica reads labels ahead (``learn``): those of the first identities as it loads, those of new faces'
identities and relabelled ones as it applies the log. Searches then label their answers from memory, and
identify keeps answering while the database is down.
"""

from __future__ import annotations

import threading
from collections.abc import Set as AbstractSet

from gallery.store.models import ChangeOp
from gallery.store.store import Change, GalleryStore

#: Identity labels remembered at most; past it the memory starts again empty.
MAX_LABELS = 100_000
#: Labels read at load: half the memory, so that the labels learnt next do not empty it at once.
LOADED_LABELS = MAX_LABELS // 2

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
            self._remember(read, generation)
            known.update(read)
        return known

    def learn(self, identity_ids: AbstractSet[int] | None = None) -> None:
        """Read and remember the labels of these identities not remembered yet (None: of the first
        ``LOADED_LABELS`` identities)."""
        with self._lock:
            generation = self._generation
            wanted = None if identity_ids is None else identity_ids - self._known.keys()
        if wanted is None:
            self._remember(self._store.first_identity_labels(LOADED_LABELS), generation)
        elif wanted:
            self._remember(self._store.identity_labels(wanted), generation)

    def _remember(self, read: dict[int, Label], generation: int) -> None:
        with self._lock:
            if generation == self._generation:  # no change to labels applied meanwhile
                if len(self._known) + len(read) > MAX_LABELS:
                    self._known.clear()
                self._known.update(read)

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
