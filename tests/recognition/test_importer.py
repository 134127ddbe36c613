"""The batch import script and re-embedding, through the real Triton and a real database."""

from __future__ import annotations

import asyncio
import csv
import hashlib
import json
import os
import shutil
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from sqlalchemy import text

from facecore.client import AsyncPipelineClient, PipelineClient, PipelineError
from gallery.errors import CropsMissing, ModelMismatch
from gallery.gallery import Gallery
from gallery.reembed import reembed_collection
from gallery.store.store import GalleryStore
from recognition.__main__ import main as recognition_main
from recognition.__main__ import parser as recognition_parser
from recognition.importer import (
    Importer,
    ImportOptions,
    ItemResult,
    LocalBackend,
    Status,
    read_manifest,
    scan_folder,
    write_report,
)
from service.launcher import TritonServer

pytestmark = pytest.mark.triton
#: ``store``: a migrated GalleryStore on SQLite and on PostgreSQL (every test runs on both).
pytest_plugins = ["tests.gallery.fixtures"]


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
    code = recognition_main(["--database-url", url, "import", "--collection", "people",
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


def cli_import(store: GalleryStore, *args: str) -> int:
    return recognition_main(["--database-url", str(store.db.engine.url), "import", "--collection", "people",
                             "-q", *args])


def identities(store: GalleryStore) -> set[str]:
    with store.db.read() as session:
        return set(session.execute(text("SELECT external_id FROM identities")).scalars())


def test_cli_errors_are_one_line_exit_2(store: GalleryStore, triton: TritonServer, folder: Path,
                                        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Triton down, a folder as manifest, a malformed CSV, a report that cannot be written: exit 2 with one
    logged line, before anything is imported."""
    big = tmp_path / "big.csv"
    big.write_text("path,external_id\n" + "x" * (csv.field_size_limit() + 1) + ",p-1\n")
    cases = {
        "Triton at 127.0.0.1:1": ["--folder", str(folder), "--url", "127.0.0.1:1", "--create-collection"],
        "Is a directory": ["--manifest", str(tmp_path), "--url", triton.grpc_url],
        "not a readable CSV": ["--manifest", str(big), "--url", triton.grpc_url],
        "no folder": ["--folder", str(folder), "--url", triton.grpc_url, "--create-collection",
                      "--report", str(tmp_path / "missing" / "report.csv")],
    }
    for message, args in cases.items():
        caplog.clear()
        assert cli_import(store, *args) == 2, message
        assert message in caplog.text and len(caplog.records) == 1, caplog.text
    assert identities(store) == set()  # the unwritable report was refused before the import


@pytest.mark.parametrize("value", ["0", "-1", "65", "many"])
def test_concurrency_out_of_range_is_refused(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        recognition_parser().parse_args(["import", "--collection", "x", "--folder", ".",
                                         "--concurrency", value])
    assert exited.value.code == 2 and "--concurrency" in capsys.readouterr().err


def test_model_mismatch_is_refused_before_the_import(store: GalleryStore, triton: TritonServer,
                                                     folder: Path, caplog: pytest.LogCaptureFixture) -> None:
    store.create_collection("people", "other_model", 128, 0.3)
    assert cli_import(store, "--folder", str(folder), "--url", triton.grpc_url) == 2
    assert "other_model" in caplog.text and "Triton serves" in caplog.text
    assert identities(store) == set()


def test_ctrl_c_writes_a_partial_report(store: GalleryStore, triton: TritonServer, folder: Path,
                                        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                        caplog: pytest.LogCaptureFixture) -> None:
    enroll = LocalBackend.enroll

    async def interrupted(backend: LocalBackend, accepted: list[ItemResult]) -> list[int]:
        if accepted[0].item.external_id == "obama":
            raise KeyboardInterrupt
        return await enroll(backend, accepted)

    monkeypatch.setattr(LocalBackend, "enroll", interrupted)
    report = tmp_path / "report.csv"
    try:
        code = cli_import(store, "--folder", str(folder), "--url", triton.grpc_url, "--create-collection",
                          "--report", str(report))
    except KeyboardInterrupt:
        pytest.fail("Ctrl-C ended the import with a traceback")
    assert code == 130 and "interrupted" in caplog.text
    with report.open() as handle:
        rows = list(csv.DictReader(handle))
    assert {row["external_id"] for row in rows} <= {"biden", "group", "empty"}
    assert {row["external_id"] for row in rows if row["status"] == "imported"} == identities(store)


def test_manifest_bom_spaces_and_invalid_rows(tmp_path: Path) -> None:
    manifest = tmp_path / "people.csv"
    manifest.write_bytes("\ufeffpath, external_id ,name\r\n a.jpg , e1 , Ada \r\nb.jpg,e2,\r\n".encode())
    items = read_manifest(manifest)
    assert [(i.path, i.external_id, i.name) for i in items] == [(tmp_path / "a.jpg", "e1", "Ada"),
                                                               (tmp_path / "b.jpg", "e2", "e2")]
    for bad in ("a/b", "x" * 257):
        manifest.write_text(f"path,external_id\nok.jpg,fine\nc.jpg,{bad}\n")
        with pytest.raises(ValueError, match=r"people\.csv:3: external_id .* is not valid"):
            read_manifest(manifest)
    manifest.write_bytes(b"path,external_id\nc.jpg,Jos\xe9\n")
    with pytest.raises(ValueError, match=r"people\.csv: not UTF-8"):
        read_manifest(manifest)


def test_a_failed_analysis_fails_only_its_file(store: GalleryStore, triton: TritonServer, folder: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The identity's other images are enrolled; the file says why it was not."""
    create_people(store, triton)
    broken = (folder / "obama" / "obama2.jpg").read_bytes()
    infer = AsyncPipelineClient.infer

    async def flaky(client: AsyncPipelineClient, data: bytes, **kwargs: object) -> object:
        if data == broken:
            raise PipelineError("Deadline Exceeded", "StatusCode.DEADLINE_EXCEEDED")
        return await infer(client, data, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(AsyncPipelineClient, "infer", flaky)
    results = {r.item.path.name: r for r in run_import(store, triton, scan_folder(folder))}
    assert {n: results[n].status.value for n in ("obama.jpg", "obama2.jpg", "obama3.jpg")} == {
        "obama.jpg": "imported", "obama2.jpg": "failed", "obama3.jpg": "imported"}
    assert results["obama2.jpg"].detail == "analysis failed: Deadline Exceeded"
    assert len(store.list_faces("people", "obama")) == 2


def test_images_are_not_kept_once_analysed(store: GalleryStore, triton: TritonServer, folder: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The local backend enrolls the analysed face, not the file; a dry run keeps neither."""
    create_people(store, triton)
    results = run_import(store, triton, scan_folder(folder), dry_run=True)
    ready = [r for r in results if r.status is Status.READY]
    assert len(ready) == 4 and all(r.face is None and r.data == b"" for r in ready)
    enroll = LocalBackend.enroll
    kept: list[int] = []

    async def recording(backend: LocalBackend, accepted: list[ItemResult]) -> list[int]:
        kept.extend(len(r.data) for r in accepted)
        return await enroll(backend, accepted)

    monkeypatch.setattr(LocalBackend, "enroll", recording)
    run_import(store, triton, scan_folder(folder))
    assert kept == [0, 0, 0, 0]


def test_names_that_are_not_utf8(store: GalleryStore, triton: TritonServer, folder: Path, tmp_path: Path,
                                 photos: dict[str, Path]) -> None:
    """A folder (identity) name that is not UTF-8 is reported per file; a file name is imported; the report
    escapes both."""
    create_people(store, triton)
    bad_folder = Path(os.fsdecode(bytes(folder) + b"/caf\xe9"))
    bad_folder.mkdir()
    shutil.copy(photos["astronaut.png"], bad_folder / "astronaut.png")
    shutil.move(folder / "obama" / "obama.jpg", Path(os.fsdecode(bytes(folder) + b"/obama/\xff.jpg")))
    results = run_import(store, triton, scan_folder(folder))
    (odd,) = [r for r in results if r.item.path.name == "astronaut.png"]
    assert odd.status is Status.UNREADABLE and "not valid UTF-8" in odd.detail
    assert len(store.list_faces("people", "obama")) == 3
    write_report(results, tmp_path / "report.csv")
    assert "\\udcff.jpg" in (tmp_path / "report.csv").read_text()


def test_the_gallery_command_line_points_at_the_import_that_moved(caplog: pytest.LogCaptureFixture) -> None:
    """``python -m gallery import`` was the batch import; it is ``python -m recognition import`` now (the
    import runs faces through the pipeline, a layer above the gallery): the old command says where it went."""
    from gallery.__main__ import main as gallery_main

    assert gallery_main(["--database-url", "sqlite:///unused.db", "import", "--collection", "x"]) == 2
    assert "python -m recognition import" in caplog.text
