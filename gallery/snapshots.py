"""Persisting a replica's indexes, with the change-log position each includes.

Erased vectors never reach the disk: a tombstoned index is rebuilt from the database first, and what the
engine stored of deleted collections (and of forgotten ones: re-embedded, or changed while not loaded
here) is removed. Collections that lost faces are persisted again soon after (``erasures``), so that
erased vectors do not stay in storage.
"""

from __future__ import annotations

from pathlib import Path

from gallery.replica import Replica


class Snapshots:
    def __init__(self, replica: Replica) -> None:
        self.replica = replica

    def write(self, collection: str | None = None, erased: bool = False) -> list[Path]:
        """Persist indexes (all, or one collection's)."""
        replica = self.replica
        written: list[str] = []
        with replica.lock:
            replica.sync()
            with replica.exclusive():
                for entry in list(replica.collections.values()):
                    if collection is not None and entry.info.name != collection:
                        continue
                    if entry.index.has_tombstones:
                        entry = replica.collections[entry.info.id] = replica.build(entry.info)
                    written += replica.engine.persist(entry.index, entry.info, replica.applied, erased)
                replica.engine.prune({info.id for info in replica.store.list_collections()})
        return [Path(p) for p in written]

    def erasures(self) -> list[Path]:
        """Persist the collections that lost faces since they were last persisted (the gateway calls this
        a few seconds after deletions)."""
        replica = self.replica
        with replica.lock:
            replica.sync()
            pending, replica.erased = replica.erased, set()
        written: list[Path] = []
        names = sorted(pending)
        for number, name in enumerate(names):
            try:
                written += self.write(name, erased=True)  # "" (a dropped collection): only prunes
            except BaseException:
                with replica.lock:  # the erased vectors are still on disk: tried again at the next call
                    replica.erased.update(names[number:])
                raise
        return written
