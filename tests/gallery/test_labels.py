"""Identity labels in search results (``gallery.labels.Labels``) and the inline search
(``Gallery.search_inline``): labels are read once and then remembered; the change log says when one must
be read again (faces removed, a new name or external id, a dropped collection), so a replica shows a
rename once it has applied the log, like an enrolment. FAISS and the real Milvus engine, SQLite and
PostgreSQL."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest
from numpy.typing import NDArray
from sqlalchemy.exc import OperationalError

from gallery import search as search_module
from gallery.gallery import SearchResult
from gallery.store.faces import FaceRecords
from gallery.store.models import ChangeOp
from gallery.store.store import GalleryStore
from tests.gallery.helpers import MODEL, GalleryFactory, new_faces, unit_vectors

pytest_plugins = ["tests.gallery.fixtures"]

DIM = 16


class CountingLabels:
    """Wraps ``GalleryStore.identity_labels`` to count its reads (and run ``during`` after one)."""

    def __init__(self, store: GalleryStore) -> None:
        self.reads = 0
        self.during: Any = None
        self._read = store.identity_labels
        store.identity_labels = self  # type: ignore[method-assign]

    def __call__(self, identity_ids: Any) -> dict[int, tuple[str, str]]:
        self.reads += 1
        read = self._read(identity_ids)
        if self.during is not None:
            during, self.during = self.during, None
            during()
        return read


def enrolled(store: GalleryStore, seed: int = 5) -> NDArray[np.float32]:
    """Collection ``c``: identities ``ann`` ("Ann") and ``bob`` ("Bob"), two faces each; ann's first face."""
    rng = np.random.default_rng(seed)
    store.create_collection("c", MODEL, DIM, 0.5)
    vectors = unit_vectors(rng, 4, DIM)
    store.add_faces("c", "ann", new_faces(vectors[:2], tag="ann"), MODEL, create=("Ann", {}))
    store.add_faces("c", "bob", new_faces(vectors[2:], tag="bob"), MODEL, create=("Bob", {}))
    return vectors[:1]


def top(results: list[SearchResult]) -> tuple[str, str]:
    best = results[0].candidates[0]
    return best.external_id, best.name


def test_labels_are_read_once_and_a_replica_shows_renames_after_it_applies_the_log(
        store: GalleryStore, make_gallery: GalleryFactory) -> None:
    query = enrolled(store)
    writer, replica = make_gallery(store), make_gallery(store)
    writer.load()
    replica.load()
    counting = CountingLabels(store)
    for _ in range(3):
        assert top(replica.search("c", query)) == ("ann", "Ann")
    assert counting.reads == 0  # read as it loaded
    store.update_identity("c", "ann", name="Ann Lee")
    assert store.changes_since(store.last_seq() - 1)[-1].op is ChangeOp.RELABEL
    writer.sync()
    assert top(writer.search("c", query)) == ("ann", "Ann Lee")
    assert top(replica.search("c", query)) == ("ann", "Ann")  # until it applies the log
    replica.sync()
    assert top(replica.search("c", query)) == ("ann", "Ann Lee")
    FaceRecords(store.db).rename("c", "ann", "ann-lee")  # a new external id
    replica.sync()
    assert top(replica.search("c", query)) == ("ann-lee", "Ann Lee")
    last = store.last_seq()
    store.update_identity("c", "ann-lee", name="Ann Lee", metadata={"team": "x"})  # same name: no relabel
    assert store.last_seq() == last


def test_a_deleted_identity_or_collection_leaves_the_results(store: GalleryStore,
                                                             make_gallery: GalleryFactory) -> None:
    query = enrolled(store)
    writer, replica = make_gallery(store), make_gallery(store)
    writer.load()
    replica.load()
    ann = replica.search("c", query)[0].candidates[0]
    assert (ann.external_id, ann.name) == ("ann", "Ann")
    store.delete_identity("c", "ann")
    replica.sync()
    assert ann.identity_id not in replica.replica.labels  # nothing of an erased identity kept
    assert [c.external_id for c in replica.search("c", query)[0].candidates] == ["bob"]
    bob = replica.search("c", query)[0].candidates[0].identity_id
    store.delete_collection("c")
    query = enrolled(store, seed=6)  # a new collection of that name, new identities
    replica.sync()
    assert bob not in replica.replica.labels and len(replica.replica.labels) == 2  # the new ann and bob
    assert top(replica.search("c", query)) == ("ann", "Ann")


def test_a_read_that_raced_a_relabel_is_not_remembered(store: GalleryStore,
                                                       make_gallery: GalleryFactory) -> None:
    query = enrolled(store)
    gallery = make_gallery(store)
    gallery.load()
    store.delete_face("c", store.list_faces("c", "ann")[1].id)
    gallery.sync()  # ann's label is forgotten (faces removed), and read again by the next search
    counting = CountingLabels(store)

    def rename_meanwhile() -> None:  # the old name was read; the rename is applied before it is kept
        store.update_identity("c", "ann", name="Ann Lee")
        gallery.sync()

    counting.during = rename_meanwhile
    assert top(gallery.search("c", query)) == ("ann", "Ann")  # what the database had when read
    assert top(gallery.search("c", query)) == ("ann", "Ann Lee") and counting.reads == 2


def test_labels_are_read_ahead_so_that_searches_answer_while_the_database_is_down(
        store: GalleryStore, make_gallery: GalleryFactory) -> None:
    """Those of the identities there at the load, those enrolled and renamed since, once applied."""
    query = enrolled(store)
    gallery = make_gallery(store)
    gallery.load()
    rng = np.random.default_rng(7)
    cat = unit_vectors(rng, 1, DIM)
    store.add_faces("c", "cat", new_faces(cat, tag="cat"), MODEL, create=("Cat", {}))
    store.update_identity("c", "bob", name="Robert")
    gallery.sync()
    bob = FaceRecords(store.db).get("c", store.list_faces("c", "bob")[0].id).vector[None]

    def down(*_: object) -> dict[int, tuple[str, str]]:
        raise OperationalError("SELECT", {}, ConnectionRefusedError("the database is down"))

    store.identity_labels = down  # type: ignore[method-assign]
    assert top(gallery.search("c", query)) == ("ann", "Ann")
    assert top(gallery.search("c", cat)) == ("cat", "Cat")
    assert top(gallery.search("c", bob)) == ("bob", "Robert")


def test_the_inline_search_equals_the_threaded_one_and_declines_what_it_cannot_answer_at_once(
        store: GalleryStore, make_gallery: GalleryFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    query = enrolled(store)
    gallery = make_gallery(store)
    assert gallery.search_inline("c", query) is None  # not loaded here yet
    gallery.load()
    if gallery.engine.shared:  # Milvus: a network call, never on the event loop
        gallery.search("c", query)
        assert gallery.search_inline("c", query) is None
        return
    threaded = gallery.search("c", query, k=2, threshold=0.2)
    assert gallery.search_inline("c", query, k=2, threshold=0.2) == threaded
    assert gallery.search_inline("c", query) == gallery.search("c", query)
    for lock, answers in ((gallery.replica.lock, True), (gallery.replica.entry("c").lock, False)):
        held, release = threading.Event(), threading.Event()

        def hold(lock: Any = lock, held: threading.Event = held, release: threading.Event = release) -> None:
            with lock:
                held.set()
                release.wait(5)

        holder = threading.Thread(target=hold)
        holder.start()
        held.wait(5)
        try:
            # the gallery's lock: a sync reading the database, no reason to wait; the collection's: its
            # index is being searched or changed in another thread
            assert (gallery.search_inline("c", query) is not None) is answers
        finally:
            release.set()
            holder.join()
    assert gallery.search_inline("c", query) is not None
    monkeypatch.setattr(search_module, "INLINE_WORK", 32 * DIM - 1)  # 1 query x 32 fetched x 16-d
    assert gallery.search_inline("c", query) is None  # larger than an inline search may be
