"""Milvus as the gallery engine: the vectors live in a Milvus server that every gateway shares.

One Milvus collection per gallery collection, ``<prefix>_c<collection id>`` (ids are never reused, so a
dropped or re-embedded collection never meets its successor's data), with the face id as primary key,
the identity id as a scalar field and the embedding under an inner-product index (``FLAT`` by default:
exact, so results equal FAISS exact search). ``<prefix>_state`` records the change-log position applied
to Milvus (key 0) and, per collection, the model and dimension it was built for. Searches and queries
use Strong consistency, and every write is confirmed by reading it back before it counts as done (see
``VISIBLE_S``): a search after an enroll sees it, and a delete is never lost. Erasure is delete, flush,
then a compaction (waited for) so that the deleted rows leave the stored segments; a server without
compaction (milvus-lite answers UNIMPLEMENTED) is logged, and the rows are then only deleted, not
rewritten.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
from numpy.typing import NDArray

from gallery.engines.base import Faces, IndexInfo
from gallery.store.store import CollectionInfo

log = logging.getLogger(__name__)

Ids = NDArray[np.int64]
Vectors = NDArray[np.float32]
STRONG = "Strong"
#: Milvus refuses larger top-k and query windows.
MAX_TOPK = 16_384
INSERT_BATCH = 5_000
_POSITION = 0  # the state row holding the applied change-log position
_BARRIER = -1  # the state row written by barriers
#: How long a write may take to show in Strong reads before it is an error. Milvus standalone and
#: cluster show it at once. milvus-lite 2.4 does not: it stamps inserted rows ``(ms << 18) + n``, n the
#: rows it has inserted since it started, and reads and deletes ``ms << 18``, so after a million rows
#: its inserts lie about 4 ms in the future: reads do not find them yet, and a delete sent before that
#: moment is lost for good (the row comes back). Hence: an insert is waited for until it reads back,
#: and a delete is followed by a barrier (a write of our own, read back: every insert sent before it,
#: by any process, now shows, as the stamps only grow) and repeated until the rows are gone.
VISIBLE_S = 30.0
#: Rows per ``face_id in [...]`` read-back query.
READ_BACK = 4_096
#: Names tried for one collection (see ``MilvusEngine._variants``).
NAME_VARIANTS = 8


def settle(pending: Callable[[], int], again: Callable[[], None], what: str) -> None:
    """Wait until ``pending()`` (rows not yet as written) is 0, calling ``again()`` after each pause."""
    deadline = time.monotonic() + VISIBLE_S
    pause = 0.002
    while left := pending():
        if time.monotonic() > deadline:
            raise TimeoutError(f"Milvus did not show {what} within {VISIBLE_S:.0f} s ({left} rows pending)")
        time.sleep(pause)
        pause = min(2 * pause, 0.1)
        again()


class MilvusIndex:
    """One gallery collection in Milvus (a ``CollectionIndex``); holds nothing but its name."""

    stale = False
    outgrown = False  # Milvus indexes its segments itself
    has_tombstones = False

    def __init__(self, client: Any, name: str, dimension: int, search_params: dict[str, Any],
                 barrier: Callable[[], None] = lambda: None, index_type: str = "FLAT") -> None:
        self.client, self.name, self.dimension = client, name, dimension
        self.index_type = index_type
        self.search_params = search_params
        self.barrier = barrier

    def describe(self) -> IndexInfo:
        return IndexInfo("milvus", self.index_type, faces=len(self))

    def __len__(self) -> int:
        rows = self.client.query(self.name, filter="", output_fields=["count(*)"], consistency_level=STRONG)
        return int(rows[0]["count(*)"])

    def _rows(self, fields: list[str]) -> Iterator[dict[str, Any]]:
        iterator = self.client.query_iterator(self.name, batch_size=4096, filter="face_id >= 0",
                                              output_fields=fields, consistency_level=STRONG)
        try:
            while batch := iterator.next():
                yield from batch
        finally:
            iterator.close()

    def face_ids(self) -> set[int]:
        return {int(row["face_id"]) for row in self._rows(["face_id"])}

    def identities(self) -> dict[int, int]:
        return {int(row["face_id"]): int(row["identity_id"]) for row in self._rows(["identity_id"])}

    def add(self, face_ids: Ids, identity_ids: Ids, vectors: Vectors, fresh: bool = False) -> None:
        """Upsert (replaying a change is harmless); ``fresh``: plain inserts into a new collection
        (an upsert is a delete plus an insert: slow for a whole collection in milvus-lite)."""
        write = self.client.insert if fresh else self.client.upsert
        for start in range(0, len(face_ids), INSERT_BATCH):
            stop = start + INSERT_BATCH
            rows = [{"face_id": int(f), "identity_id": int(i), "embedding": v.tolist()}
                    for f, i, v in zip(face_ids[start:stop], identity_ids[start:stop], vectors[start:stop],
                                       strict=True)]
            write(self.name, rows)
        wanted = [int(f) for f in face_ids]
        if fresh:  # a new collection holds these rows only: counting them is enough
            settle(lambda: max(0, len(wanted) - len(self)), lambda: None,
                   f"{len(wanted)} rows inserted into {self.name}")
        else:
            settle(lambda: len(set(wanted) - self.present(wanted)), lambda: None,
                   f"{len(wanted)} rows written to {self.name}")

    def remove(self, face_ids: Ids) -> None:
        doomed = [int(f) for f in face_ids]
        if not doomed:
            return
        self.client.delete(self.name, ids=doomed)
        # A version of these rows written just before (a replayed add, or one by a writer killed before
        # its insert showed) may still lie ahead: past the barrier it shows, and a delete masks it.
        self.barrier()
        left = doomed

        def pending() -> int:
            nonlocal left
            left = sorted(self.present(doomed))
            return len(left)

        settle(pending, lambda: self.client.delete(self.name, ids=left),
               f"the deletion of {len(doomed)} rows from {self.name}")

    def present(self, face_ids: list[int]) -> set[int]:
        """Which of ``face_ids`` a Strong read finds."""
        found: set[int] = set()
        for start in range(0, len(face_ids), READ_BACK):
            chunk = face_ids[start:start + READ_BACK]
            # room for more than one version of a row (an upsert does not mask a version still ahead)
            rows = self.client.query(self.name, filter=f"face_id in {chunk}", output_fields=["face_id"],
                                     consistency_level=STRONG, limit=min(MAX_TOPK, 4 * len(chunk)))
            found |= {int(row["face_id"]) for row in rows}
        return found

    def search(self, queries: Vectors, k: int) -> tuple[Vectors, Ids, Ids]:
        limit = max(1, min(k, MAX_TOPK))
        hits = self.client.search(self.name, data=[q.tolist() for q in queries], limit=limit,
                                  output_fields=["identity_id"], consistency_level=STRONG,
                                  search_params={"metric_type": "IP", "params": self.search_params})
        scores = np.full((len(queries), limit), -np.inf, np.float32)
        ids = np.full((len(queries), limit), -1, np.int64)
        owners = np.full((len(queries), limit), -1, np.int64)
        for row, found in enumerate(hits):
            for rank, hit in enumerate(found):
                scores[row, rank], ids[row, rank] = hit["distance"], hit["id"]
                owners[row, rank] = hit["entity"]["identity_id"]
        return scores, ids, owners


class MilvusEngine:
    """An ``Engine`` on a Milvus server (standalone, cluster, or milvus-lite for tests)."""

    shared = True

    def __init__(self, uri: str, token: str | None = None, prefix: str = "facerec", index_type: str = "FLAT",
                 index_params: dict[str, Any] | None = None, search_params: dict[str, Any] | None = None,
                 client: Any = None) -> None:
        if not uri and client is None:
            raise ValueError("the Milvus backend needs a URI (FACEREC_GALLERY__MILVUS_URI)")
        if client is None:
            from pymilvus import MilvusClient  # the `milvus` extra

            client = MilvusClient(uri=uri, token=token or "")
        self.client, self.prefix = client, prefix
        self.index_type, self.index_params = index_type, dict(index_params or {})
        self.search_params = dict(search_params or {})
        #: (collection, outcome) of each compaction asked for: "completed" or "unsupported by the server"
        self.compactions: list[tuple[str, str]] = []
        self._state = self._ensure_state()

    @staticmethod
    def _variants(base: str) -> list[str]:
        """``base``, then the names tried when milvus-lite cannot create an index under it: it writes the
        index description into an SQL statement unescaped, so a name whose description holds a quote
        (about 1 in 128 names, always the same ones) fails with "internal error" every time."""
        return [base] + [f"{base}v{n}" for n in range(1, NAME_VARIANTS)]

    def _existing(self, base: str) -> str | None:
        present = set(self.client.list_collections())
        return next((name for name in self._variants(base) if name in present), None)

    def _create(self, base: str, schema: Any, params: Any) -> str:
        """Create the collection under ``base`` or, where the index cannot be created, the next variant."""
        from pymilvus.exceptions import MilvusException

        for name in self._variants(base):
            try:
                self.client.create_collection(name, schema=schema, index_params=params,
                                              consistency_level=STRONG)
                return name
            except MilvusException:
                if not self.client.has_collection(name):
                    raise  # not the index-description fault: the collection was not created at all
                log.warning("Milvus could not create the index of %s (milvus-lite's unescaped index "
                            "description?): trying another name", name)
                self.client.drop_collection(name)
        raise RuntimeError(f"Milvus could not create an index under any of {self._variants(base)}")

    @property
    def state_name(self) -> str:
        return self._state

    def _base(self, collection_id: int) -> str:
        return f"{self.prefix}_c{collection_id}"

    def name(self, collection_id: int) -> str:
        """The Milvus collection of a gallery collection: ``<prefix>_c<id>`` (or a variant of it)."""
        return self._existing(self._base(collection_id)) or self._base(collection_id)

    # --- state: the applied position and what each collection was built for -------------------

    def _ensure_state(self) -> str:
        base = f"{self.prefix}_state"
        existing = self._existing(base)
        if existing is not None:
            return existing
        from pymilvus import DataType

        schema = self.client.create_schema(auto_id=False, enable_dynamic_field=False)
        schema.add_field("key", DataType.INT64, is_primary=True)
        schema.add_field("seq", DataType.INT64)
        schema.add_field("model", DataType.VARCHAR, max_length=256)
        schema.add_field("dimension", DataType.INT64)
        schema.add_field("unused", DataType.FLOAT_VECTOR, dim=2)  # Milvus wants a vector field
        params = self.client.prepare_index_params()
        params.add_index("unused", index_type="FLAT", metric_type="L2")
        return self._create(base, schema, params)

    def _state_row(self, key: int) -> dict[str, Any] | None:
        rows = self.client.query(self._state, filter=f"key == {int(key)}",
                                 output_fields=["seq", "model", "dimension"], consistency_level=STRONG)
        return rows[0] if rows else None

    def _write_state(self, key: int, seq: int, model: str = "", dimension: int = 0) -> None:
        wanted = {"seq": int(seq), "model": model, "dimension": int(dimension)}

        def write() -> None:
            self.client.upsert(self._state, [{"key": int(key), **wanted, "unused": [0.0, 0.0]}])

        def pending() -> int:
            row = self._state_row(key)
            return 0 if row is not None and {k: row[k] for k in wanted} == wanted else 1

        write()
        settle(pending, lambda: None, f"state row {key} of {self._state}")

    def _forget_state(self, key: int) -> None:
        def delete() -> None:
            self.client.delete(self._state, ids=[int(key)])

        delete()
        settle(lambda: int(self._state_row(key) is not None), delete, f"the deletion of state row {key}")

    def position(self) -> int | None:
        row = self._state_row(_POSITION)
        return None if row is None else int(row["seq"])

    def record(self, seq: int) -> None:
        self._write_state(_POSITION, seq)

    # --- collections ---------------------------------------------------------------------------

    def _index(self, name: str, info: CollectionInfo) -> MilvusIndex:
        return MilvusIndex(self.client, name, info.dimension, self.search_params, self.barrier,
                           self.index_type)

    def barrier(self) -> None:
        """Write a state row and wait until it reads back: every insert sent before, by any client, then
        shows (milvus-lite's insert stamps only grow; on Milvus proper a write shows at once)."""
        self._write_state(_BARRIER, time.time_ns())

    def open(self, info: CollectionInfo, identities: Faces) -> tuple[MilvusIndex, int] | None:
        row = self._state_row(info.id)
        name = self._existing(self._base(info.id))
        if row is None or name is None or row["model"] != info.embedding_model \
                or int(row["dimension"]) != info.dimension:
            if name is not None or row is not None:
                log.warning("Milvus collection %s does not match %s (%s, %d-d): rebuilding it",
                            name or self._base(info.id), info.name, info.embedding_model, info.dimension)
            return None
        return self._index(name, info), self.position() or 0

    def build(self, info: CollectionInfo, ids: Ids, identities: Ids, vectors: Vectors) -> MilvusIndex:
        from pymilvus import DataType

        self.forget(info.id)
        schema = self.client.create_schema(auto_id=False, enable_dynamic_field=False)
        schema.add_field("face_id", DataType.INT64, is_primary=True)
        schema.add_field("identity_id", DataType.INT64)
        schema.add_field("embedding", DataType.FLOAT_VECTOR, dim=info.dimension)
        params = self.client.prepare_index_params()
        params.add_index("embedding", index_type=self.index_type, metric_type="IP", params=self.index_params)
        name = self._create(self._base(info.id), schema, params)
        index = self._index(name, info)
        index.add(ids, identities, vectors, fresh=True)
        self.client.flush(name)
        self._write_state(info.id, 0, info.embedding_model, info.dimension)
        log.info("built Milvus collection %s: %d faces of %s", name, len(ids), info.name)
        return index

    def forget(self, collection_id: int) -> None:
        present = set(self.client.list_collections())
        for name in self._variants(self._base(collection_id)):
            if name in present:
                self.client.drop_collection(name)
        self._forget_state(collection_id)

    def persist(self, index: Any, info: CollectionInfo, seq: int, erased: bool) -> list[str]:
        name = index.name if isinstance(index, MilvusIndex) else self.name(info.id)
        self.client.flush(name)
        if erased:
            self.compact(name)
        return []

    def compact(self, name: str, timeout_s: float = 300.0) -> str:
        """Compact ``name`` so deleted rows leave its segments, and wait for it to finish."""
        from grpc import RpcError, StatusCode

        try:
            job = self.client.compact(name)
        except RpcError as exc:
            if exc.code() is not StatusCode.UNIMPLEMENTED:
                raise
            log.warning("the Milvus server cannot compact %s (milvus-lite?): deleted rows are not "
                        "rewritten out of its storage", name)
            self.compactions.append((name, "unsupported by the server"))
            return "unsupported"
        deadline = time.monotonic() + timeout_s
        while str(self.client.get_compaction_state(job)) != "Completed":
            if time.monotonic() > deadline:
                raise TimeoutError(f"compaction of {name} did not finish within {timeout_s} s")
            time.sleep(0.5)
        self.compactions.append((name, "completed"))
        return "completed"

    def prune(self, live: set[int]) -> None:
        head = f"{self.prefix}_c"
        for name in self.client.list_collections():
            number = name.removeprefix(head).split("v")[0]  # <id> or <id>v<n> (a name variant)
            if name.startswith(head) and number.isdigit() and int(number) not in live:
                self.forget(int(number))
