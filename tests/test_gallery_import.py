"""The batch import script and re-embedding, through the real Triton and a real database."""

from __future__ import annotations

import asyncio
import csv
import hashlib
import json
import shutil
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from sqlalchemy import text

from facecore.client import AsyncPipelineClient, PipelineClient
from gallery.__main__ import main as gallery_main
from gallery.errors import CropsMissing, ModelMismatch
from gallery.gallery import Gallery
from gallery.reembed import reembed_collection
from gallery.store import GalleryStore
from recognition.importer import Importer, ImportOptions, Status, read_manifest, scan_folder
from service.launcher import TritonServer

pytestmark = pytest.mark.triton
#: ``store``: a migrated GalleryStore on SQLite and on PostgreSQL (every test runs on both).
pytest_plugins = ["tests.gallery_fixtures"]


@pytest.fixture
def folder(tmp_path: Path, photos: dict[str, Path]) -> Path:
    """obama/ (3 photos), biden/ (1), group/ (6 faces), empty/ (no face + a broken file)."""
    root = tmp_path / "people"
    layout = {"obama": ["obama.jpg", "obama2.jpg", "obama3.jpg"], "biden": ["biden.jpg"], "group": ["t1.jpg"],
              "empty": ["coffee.png"]}
    for person, names in layout.items():
        (root / person).mkdir(parents=True)
        for name in names:
            shutil.copy(photos[name], root / person / name)
    (root / "empty" / "broken.jpg").write_bytes(b"\xff\xd8 not really a jpeg")
    return root


def run_import(store: GalleryStore, triton: TritonServer, items: list, **options: object) -> list:  # type: ignore[type-arg]
    async def go() -> list:  # type: ignore[type-arg]
        client = AsyncPipelineClient(triton.grpc_url)
        try:
            spec = await client.embedder()
            opts = ImportOptions("people", spec.name, **options)  # type: ignore[arg-type]
            return await Importer(store, client, opts).run(items, show_progress=False)
        finally:
            await client.close()

    return asyncio.run(go())


def statuses(results: list) -> dict[str, str]:  # type: ignore[type-arg]
    return {r.item.path.name: r.status.value for r in results}


def create_people(store: GalleryStore, triton: TritonServer, keep_crops: bool = True) -> None:
    client = PipelineClient(triton.grpc_url)
    spec = client.embedder()
    client.close()
    store.create_collection("people", spec.name, spec.embedding_dim, spec.match_threshold, keep_crops)


def test_folder_import_statuses_resume_and_search(store: GalleryStore, triton: TritonServer,
                                                   folder: Path) -> None:
    create_people(store, triton)
    follower = Gallery(store)  # like a running gateway: it only follows the change log
    follower.load()
    follower.start_follower(0.1)
    results = run_import(store, triton, scan_folder(folder), concurrency=4)
    deadline = time.monotonic() + 1.0
    while follower.size("people") < 4 and time.monotonic() < deadline:
        time.sleep(0.05)
    follower.stop_follower()
    assert follower.size("people") == 4
    assert statuses(results) == {"obama.jpg": "imported", "obama2.jpg": "imported", "obama3.jpg": "imported",
                                 "biden.jpg": "imported", "t1.jpg": "several_faces", "coffee.png": "no_face",
                                 "broken.jpg": "unreadable"}
    group = next(r for r in results if r.item.path.name == "t1.jpg")
    assert group.faces == 6 and group.detail.count(";") == 5  # lists the six boxes
    again = run_import(store, triton, scan_folder(folder))
    assert {s for name, s in statuses(again).items()
            if name.endswith(("obama.jpg", "biden.jpg"))} == {"duplicate"}
    gallery = Gallery(store)
    gallery.load()
    assert gallery.size("people") == 4
    probe = PipelineClient(triton.grpc_url).infer((folder / "obama" / "obama2.jpg").read_bytes())
    (result,) = gallery.search("people", probe.embeddings, k=2)
    assert result.match is not None and result.match.external_id == "obama"


def test_largest_face_option_and_quality_gate(store: GalleryStore, triton: TritonServer,
                                              folder: Path) -> None:
    create_people(store, triton)
    items = [i for i in scan_folder(folder) if i.external_id == "group"]
    (result,) = run_import(store, triton, items, largest_face=True)
    assert result.status is Status.IMPORTED
    from facecore.quality import QualityThresholds

    strict = QualityThresholds(min_face_size=2000)
    items = [i for i in scan_folder(folder) if i.external_id == "biden"]
    (result,) = run_import(store, triton, items, quality=strict)
    assert result.status is Status.LOW_QUALITY and "face_too_small" in result.detail


def test_each_image_is_hashed_once(store: GalleryStore, triton: TritonServer, folder: Path,
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The duplicate check, the quality gate and the stored face share one sha256 of each file (it was taken
    three times: 0.14 ms each for a 280 KB photo, on the importer's event loop)."""
    create_people(store, triton)
    items = [i for i in scan_folder(folder) if i.external_id in ("obama", "biden")]
    images = {i.path.read_bytes() for i in items}
    hashed: list[bytes] = []
    sha256 = hashlib.sha256

    def counting(data: bytes = b"", **kwargs: object) -> object:
        if data in images:
            hashed.append(data)
        return sha256(data, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(hashlib, "sha256", counting)
    results = run_import(store, triton, items)
    assert {r.status for r in results} == {Status.IMPORTED}
    assert sorted(hashed) == sorted(images)
    stored = {f.image_sha256 for person in ("obama", "biden") for f in store.list_faces("people", person)}
    assert stored == {sha256(data).hexdigest() for data in images}


def test_dry_run_writes_nothing(store: GalleryStore, triton: TritonServer, folder: Path) -> None:
    create_people(store, triton)
    results = run_import(store, triton, scan_folder(folder), dry_run=True)
    assert statuses(results)["obama.jpg"] == "ready"
    with store.db.read() as session:
        assert session.execute(text("SELECT count(*) FROM faces")).scalar() == 0
        assert session.execute(text("SELECT count(*) FROM identities")).scalar() == 0


def test_a_failed_identity_is_not_half_enrolled(store: GalleryStore, triton: TritonServer, folder: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    create_people(store, triton)
    original = store.add_faces

    def flaky(collection: str, external_id: str, *args: object, **kwargs: object) -> object:
        if external_id == "obama":
            raise RuntimeError("database connection lost")
        return original(collection, external_id, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(store, "add_faces", flaky)
    results = run_import(store, triton, scan_folder(folder))
    assert {r.status for r in results if r.item.external_id == "obama"} == {Status.FAILED}
    with store.db.read() as session:
        names = set(session.execute(text("SELECT external_id FROM identities")).scalars())
        assert names == {"biden"}


def test_manifest_cli_report_and_reembed(store: GalleryStore, triton: TritonServer, folder: Path,
                                         tmp_path: Path) -> None:
    manifest = tmp_path / "manifest.csv"
    with manifest.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["path", "external_id", "name"])
        writer.writerow([str(folder / "obama" / "obama.jpg"), "p-1", "Barack Obama"])
        writer.writerow(["people/biden/biden.jpg", "p-2", "Joe Biden"])  # relative to the manifest
    assert len(read_manifest(manifest)) == 2
    url = str(store.db.engine.url)
    report = tmp_path / "report.json"
    code = gallery_main(["--database-url", url, "import", "--collection", "people",
                         "--manifest", str(manifest), "--url", triton.grpc_url, "--create-collection",
                         "--report", str(report), "-q"])
    assert code == 0
    rows = json.loads(report.read_text())
    assert [(r["external_id"], r["status"]) for r in rows] == [("p-1", "imported"), ("p-2", "imported")]
    assert store.get_identity("people", "p-1").name == "Barack Obama"

    client = PipelineClient(triton.grpc_url)
    spec = client.embedder()
    before = store.collection_vectors(store.get_collection("people").id, spec.embedding_dim)[2]
    assert reembed_collection(store, "people", client, replace(spec, name="sface_v2")) == 2
    info = store.get_collection("people")
    after = store.collection_vectors(info.id, spec.embedding_dim)[2]
    assert info.embedding_model == "sface_v2"
    assert np.min(np.sum(before * after, axis=1)) > 0.999  # same network on lossless crops
    with pytest.raises(ModelMismatch):
        store.add_faces("people", "p-1", [], spec.name)


def test_reembed_refuses_without_crops(store: GalleryStore, triton: TritonServer, folder: Path) -> None:
    create_people(store, triton, keep_crops=False)
    run_import(store, triton, [i for i in scan_folder(folder) if i.external_id == "biden"])
    client = PipelineClient(triton.grpc_url)
    with pytest.raises(CropsMissing, match="no stored crop"):
        reembed_collection(store, "people", client, client.embedder())
