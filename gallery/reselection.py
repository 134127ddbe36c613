"""A collection's index chosen again in the background when the collection outgrew it.

An exact collection past ``exact_max`` (or past twice the size its exact scan was timed at) would stay an
exact scan whose cost grows with every face; a measured one, at ``reselect_growth`` times the size it was
measured at, may no longer reach the targets with its re-rank depth or nprobe (``FaissIndex.outgrown``).
A new index is built from the database in a thread at a lower CPU priority while the current one keeps
serving, caught up with the changes applied meanwhile, and swapped in under the replica's lock.
"""

from __future__ import annotations

import logging
import threading
import time

from gallery.engines.threads import at_low_priority
from gallery.replica import CollectionEntry, Replica
from gallery.store.models import ChangeOp

log = logging.getLogger(__name__)

#: How a background index selection ends: the new index took over; the collection was dropped, re-embedded
#: or rebuilt meanwhile (the new index was thrown away); or it raised (tried again after RESELECT_RETRY_S).
RESELECT_OUTCOMES = ("chosen", "outdated", "failed")
#: After a background index selection failed, seconds before the collection's next one.
RESELECT_RETRY_S = 600.0
#: The changes that touch an index's vectors.
_VECTORS = (ChangeOp.ADD, ChangeOp.REMOVE)


class Reselection:
    """The background selections of one replica (one of its ``upkeep``); ``start`` is called under the
    replica's lock."""

    def __init__(self, replica: Replica) -> None:
        self.replica = replica
        #: collections whose index is being chosen again now, and when such a choice last failed
        self.running: dict[int, threading.Thread] = {}
        self.failed: dict[int, float] = {}
        #: selections finished, by outcome (``RESELECT_OUTCOMES``)
        self.outcomes: dict[str, int] = dict.fromkeys(RESELECT_OUTCOMES, 0)
        #: the process is stopping: a selection that fails is abandoned, not an error
        self.closing = False

    def due(self, entry: CollectionEntry) -> bool:
        """The entry's index is outgrown, no selection of it runs, and none failed within
        ``RESELECT_RETRY_S``."""
        collection_id = entry.info.id
        failed = self.failed.get(collection_id)
        return entry.index.outgrown and collection_id not in self.running and (
            failed is None or time.monotonic() - failed >= RESELECT_RETRY_S)

    def start(self, entry: CollectionEntry) -> None:
        thread = threading.Thread(target=self._reselect, args=(entry,), name=f"reselect-{entry.info.id}",
                                  daemon=True)
        self.running[entry.info.id] = thread
        thread.start()

    def _reselect(self, entry: CollectionEntry) -> None:
        replica, info, began = self.replica, entry.info, time.perf_counter()
        try:
            with replica.lock:
                since = replica.applied  # the vectors read below include at least every change up to here
            log.info("collection %s grew past the size its index was chosen for (%d faces): choosing it "
                     "again in the background", info.name, len(entry.index))
            built = at_low_priority(lambda: replica.build_index(info))  # requests served meanwhile go first
            with replica.lock:
                if replica.collections.get(info.id) is not entry:
                    self.outcomes["outdated"] += 1
                    return  # dropped, re-embedded or rebuilt meanwhile: this build is out of date
                start, fresh = since, CollectionEntry(info, built)
                while start < replica.applied and (changes := replica.store.changes_since(start)):
                    mine = [c for c in changes if c.seq <= replica.applied and c.collection_id == info.id]
                    if not replica.apply_to(fresh, [c for c in mine if c.op in _VECTORS]):
                        self.outcomes["outdated"] += 1
                        return  # re-embedded meanwhile: its DROP, not applied yet, drops the current index
                    start = changes[-1].seq
                replica.collections[info.id] = fresh
                replica.erased.add(info.name)  # persisted within seconds: a restart loads the new kind
                self.outcomes["chosen"] += 1
            log.info("collection %s: new index in %.1f s (%d faces)", info.name, time.perf_counter() - began,
                     len(built))
        except Exception:  # the current index keeps serving; tried again after RESELECT_RETRY_S
            if self.closing:  # e.g. the index's search threads were shut down with the interpreter under it
                log.info("collection %s: choosing its index again was abandoned: the process is stopping "
                         "(it starts again at the next start)", info.name)
                return
            log.exception("choosing the index of collection %s again failed", info.name)
            with replica.lock:
                self.failed[info.id] = time.monotonic()
                self.outcomes["failed"] += 1
        finally:
            with replica.lock:
                self.running.pop(info.id, None)

    def state(self) -> tuple[int, dict[str, int]]:
        """Selections running now, and those finished by outcome: for the metrics, read on the event loop,
        so without the lock (``len`` and copying a dict are atomic)."""
        return len(self.running), dict(self.outcomes)

    def join(self, timeout: float | None = None) -> None:
        """Wait for the selections under way (tests, shutdown)."""
        for thread in list(self.running.values()):
            thread.join(timeout)
