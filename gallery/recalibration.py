"""A collection's own impostor scores measured again in the background as it grows (``fpir`` policy).

The sampled cross-identity scores (``calibration.measured_calibration``) are read from the database's
vectors in a thread at a lower CPU priority, then stored with a ``policy`` row in the change log: every
replica, this one included, reads the collection again and decides with the new tail. Several gateways
may measure the same growth; the last to store wins, and they measured the same faces.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from gallery.calibration import measured_calibration, refit_due
from gallery.engines.threads import at_low_priority
from gallery.replica import CollectionEntry, Replica
from gallery.store.policies import CollectionPolicies

log = logging.getLogger(__name__)

#: After a measurement failed, seconds before the collection's next one.
RETRY_S = 600.0


class Recalibration:
    """One of a replica's ``upkeep``: ``start`` is called under the replica's lock."""

    def __init__(self, replica: Replica, policies: CollectionPolicies) -> None:
        self.replica, self.policies = replica, policies
        self.running: dict[int, threading.Thread] = {}
        self.failed: dict[int, float] = {}
        self.closing = False

    def due(self, entry: CollectionEntry) -> bool:
        collection_id = entry.info.id
        failed = self.failed.get(collection_id)
        return (collection_id not in self.running and (failed is None or time.monotonic() - failed >= RETRY_S)
                and refit_due(entry.info, len(entry.index)))

    def start(self, entry: CollectionEntry) -> None:
        thread = threading.Thread(target=self._measure, args=(entry,), name=f"calibrate-{entry.info.id}",
                                  daemon=True)
        self.running[entry.info.id] = thread
        thread.start()

    def _measure(self, entry: CollectionEntry) -> None:
        info, began = entry.info, time.perf_counter()
        store = self.replica.store
        try:
            def measure() -> dict[str, Any] | None:
                _, identities, vectors = store.collection_vectors(info.id, info.dimension)
                return measured_calibration(identities, vectors)

            measured = at_low_priority(measure)
            # too few cross-identity pairs is an answer too: stored, so it is asked again only after growth
            calibration = measured or {"faces": len(entry.index)}
            if self.policies.save_calibration(info.id, info.embedding_model, calibration):
                found = ("too few pairs: the model's reference decides" if measured is None
                         else f"{measured['impostor']['pairs']} pairs")
                log.info("collection %s: impostor scores measured on %s faces in %.1f s (%s)", info.name,
                         calibration["faces"], time.perf_counter() - began, found)
            self.replica.sync()
        except Exception:
            if self.closing:
                return
            log.exception("measuring the scores of collection %s failed", info.name)
            with self.replica.lock:
                self.failed[info.id] = time.monotonic()
        finally:
            with self.replica.lock:
                self.running.pop(info.id, None)

    def join(self, timeout: float | None = None) -> None:
        """Wait for the measurements under way (tests, shutdown)."""
        for thread in list(self.running.values()):
            thread.join(timeout)
