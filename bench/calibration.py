"""``python -m bench.calibration``: decisions at a target FPIR on real faces and on synthetic galleries
fitted to them (issue 40's targets; results in docs/benchmarks/calibration.md).

- ``faces``: every real face of this machine (the pinned photos; CompreFace's sample photos in
  ``../shared/faces`` where present) as a labelled folder for ``python -m recognition evaluate``.
- ``synthetic``: labelled embeddings from a model fitted to the real faces, several faces a person, for
  ``evaluate --embeddings``: the fusions compared where people have many faces.
- ``run``: galleries of ``--sizes`` synthetic identities fitted to half the real people, the other half
  real strangers: strangers matched (FPIR) and genuine probes missed (FNIR) at the threshold the ``fpir``
  policy derives from each gallery's own scores, beside the fixed threshold; the calibration's CPU per
  identify; re-deriving after an import.
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
import time
import zlib
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import cv2
import faiss
import numpy as np
from numpy.typing import NDArray

from bench.core.inputs import ARTIFACTS, ROOT
from bench.core.reporting import cli, command_line, machine_description, run_header, table, write_section
from facecore.client import PipelineClient
from gallery.calibration import FPIR, decide, measured_calibration
from gallery.store.store import CollectionInfo

SHARED = ROOT.parent / "shared" / "faces" / "compreface-samples"
#: Faces of two group photos that are one person, checked by eye (the annotations do not say who appears
#: in two photos): the two young women of 010_2.jpg are faces 3 and 5 of 016_8.jpg.
SAME_PERSON = {"cf_016_3": "cf_010_1", "cf_016_5": "cf_010_0"}
PINNED = {"obama.jpg": "obama", "obama2.jpg": "obama", "obama3.jpg": "obama", "biden.jpg": "biden",
          "astronaut.png": "astronaut", "Tom_Hanks_54745.png": "hanks"}
Vectors = NDArray[np.float32]


# --- the real faces ---------------------------------------------------------------------------------


def build_faces(out: Path, url: str) -> dict[str, int]:
    """Write the labelled folder; returns images per person. Faces in group photos are cut out with a
    margin of half their size around the detected box that holds the annotated nose: enough for
    the detector to find it again, too little for a neighbour to be the crop's largest face."""
    client = PipelineClient(url)
    photos = ARTIFACTS / "photos"
    written: dict[str, int] = {}

    def save(person: str, name: str, image: NDArray[Any]) -> None:
        folder = out / person
        folder.mkdir(parents=True, exist_ok=True)
        cv2.imwrite(str(folder / name), image)
        written[person] = written.get(person, 0) + 1

    for name, person in PINNED.items():
        save(person, Path(name).stem + ".png", cv2.imread(str(photos / name)))
    group = photos / "t1.jpg"
    for number, face in enumerate(_faces(client, group, None)):
        save(f"t1_{number}", "t1.png", face)
    for name, noses in _annotations().items():
        annotated = re.fullmatch(r"\d+_([A-Z])\.jpg", name)  # a photo of one of CompreFace's named people
        for number, face in enumerate(_faces(client, SHARED / name, noses)):
            label = f"cf_{annotated.group(1)}" if annotated else f"cf_{name[:3]}_{number}"
            save(SAME_PERSON.get(label, label), Path(name).stem + ".png", face)
    client.close()
    return written


def _annotations() -> dict[str, list[tuple[int, int]]]:
    """CompreFace's annotated noses per photo (its ``annotations.py``, read as text: it imports ``attr``)."""
    if not (SHARED / "annotations.py").exists():
        return {}
    text = (SHARED / "annotations.py").read_text()
    return {m.group(1): [(int(x), int(y)) for x, y in re.findall(r"\((\d+), (\d+)\)", m.group(2))]
            for m in re.finditer(r"Row\('([^']+)', \[(.*?)\]\)", text, re.S) if m.group(2).strip()}


def _faces(client: PipelineClient, path: Path, noses: list[tuple[int, int]] | None
           ) -> list[NDArray[Any]]:
    image = cv2.imread(str(path))
    found = client.infer(path.read_bytes())
    boxes = found.boxes.tolist()
    if noses is not None:  # the smallest detected box around each annotated nose
        boxes = [min((b for b in boxes if b[0] <= x <= b[2] and b[1] <= y <= b[3]),
                     key=lambda b: b[2] - b[0], default=None) for x, y in noses]
    crops = []
    for box in boxes:
        if box is None:
            continue
        x1, y1, x2, y2 = box
        w, h = (x2 - x1) / 2, (y2 - y1) / 2
        top, left = max(0, int(y1 - h)), max(0, int(x1 - w))
        crops.append(image[top:int(y2 + h), left:int(x2 + w)])
    return crops


# --- a generator fitted to real faces ---------------------------------------------------------------


@dataclass(frozen=True)
class Generator:
    """Faces as unit vectors: an identity's centre is the real faces' mean (scaled), a Gaussian in their
    principal directions (scaled), isotropic noise and the direction of its group (people who look alike;
    the population's groups, which strangers share with the enrolled); a face is its centre plus noise of
    its own size, so that two faces of one person score like the real genuine pairs (mean, sd)."""

    mean: Vectors
    axes: Vectors  # [k, d] principal directions scaled by their standard deviations
    spread: float
    noise: float
    shared: Vectors  # [groups, d] the groups' directions
    group_weight: float
    genuine_mean: float
    genuine_sd: float

    def identities(self, count: int, rng: np.random.Generator) -> Vectors:
        d = self.mean.size
        centres = (self.mean + self.spread * rng.standard_normal((count, len(self.axes))) @ self.axes
                   + self.noise * rng.standard_normal((count, d)))
        group = rng.integers(0, len(self.shared), count)
        return _unit(centres + self.group_weight * self.shared[group])

    def faces(self, centres: Vectors, rng: np.random.Generator) -> Vectors:
        # a face at noise t scores about 1 / sqrt(1 + t^2) with its centre, so two faces of qualities q1, q2
        # score about sqrt(q1 q2) with each other: q is drawn around the genuine mean with sqrt(2) times the
        # genuine spread, which the pair's two draws halve
        spread = self.genuine_sd * np.sqrt(2)
        quality = np.clip(rng.normal(self.genuine_mean, spread, len(centres)), 0.2, 0.99)
        size = np.sqrt(1 / quality - 1)[:, None]
        noise = rng.standard_normal(centres.shape) / np.sqrt(centres.shape[1])
        return _unit(centres + size * noise)


def _unit(x: NDArray[Any]) -> Vectors:
    unit: Vectors = (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)
    return unit


def _stats(scores: NDArray[Any]) -> NDArray[np.float64]:
    return np.array([scores.mean(), scores.std(), *np.quantile(scores, [0.99, 0.999])])


def fit_generator(faces: Vectors, labels: list[str], seed: int = 0) -> tuple[Generator, dict[str, Any]]:
    """The generator whose faces' impostor scores best match the real ones (mean, sd, 99th and 99.9th
    percentiles, on a grid) and whose genuine scores match theirs (mean)."""
    one = np.array([labels.index(p) for p in dict.fromkeys(labels)])
    first = faces[one].astype(np.float64)
    real = first @ first.T
    impostor = real[np.triu_indices(len(first), 1)]
    same = [(i, j) for i in range(len(labels)) for j in range(i + 1, len(labels)) if labels[i] == labels[j]]
    genuine_scores = np.array([faces[i] @ faces[j] for i, j in same]) if same else np.array([0.75, 0.75])
    genuine, genuine_sd = float(genuine_scores.mean()), float(genuine_scores.std())
    centred = first - first.mean(0)
    _, singular, axes = np.linalg.svd(centred, full_matrices=False)
    scaled = (singular[:, None] * axes / np.sqrt(max(len(first) - 1, 1))).astype(np.float32)
    target, rng, best = _stats(impostor), np.random.default_rng(seed), None
    grid = itertools.product((0.4, 0.6, 0.8), (0.0, 0.05, 0.1), ((1, 0.0), (30, 0.5), (100, 0.7), (100, 0.9)),
                             (0.7, 0.85, 1.0))
    for spread, noise, (groups, weight), shrink in grid:
        mean = first.mean(0).astype(np.float32) * shrink
        shared = (mean + spread * rng.standard_normal((groups, len(scaled))) @ scaled)
        made = Generator(mean, scaled, spread, noise, shared.astype(np.float32), weight, genuine, genuine_sd)
        strangers = made.faces(made.identities(1500, rng), rng)  # drawn apart, as in a run
        enrolled = made.faces(made.identities(1500, rng), rng)
        got = _stats((strangers @ enrolled.T).ravel())
        error = float(np.abs(got - target) @ np.array([1.0, 1.0, 1.0, 0.5]))
        if best is None or error < best[0]:
            best = (error, made, got)
    assert best is not None
    _, chosen, got = best
    sample = chosen.faces(chosen.identities(2000, rng), rng)
    pairs = chosen.faces(np.repeat(chosen.identities(1000, rng), 2, axis=0), rng)
    made = np.sum(pairs[0::2] * pairs[1::2], axis=1)
    fit = {"impostor real": target.round(4).tolist(), "impostor fitted": got.round(4).tolist(),
           "genuine real": [round(genuine, 4), round(genuine_sd, 4)],
           "genuine fitted": [round(float(made.mean()), 4), round(float(made.std()), 4)],
           "identities": len(first), "impostor pairs": int(impostor.size), "faces": len(sample)}
    return chosen, fit


# --- galleries at a size -------------------------------------------------------------------------------


@dataclass(frozen=True)
class SizeRow:
    size: int
    threshold: float
    basis: str
    fpir: tuple[int, int]  # synthetic strangers matched, of
    real_fpir: tuple[int, int]  # real strangers (faces) matched, of
    fnir: tuple[int, int]  # genuine probes missed, of
    fixed_fpir: tuple[int, int]
    fixed_real: tuple[int, int]
    fixed_fnir: tuple[int, int]
    measure_s: float


def _best(index: faiss.IndexFlatIP, queries: Vectors) -> tuple[NDArray[np.float32], NDArray[np.int64]]:
    scores, ids = index.search(queries, 1)
    return scores[:, 0], ids[:, 0]


def gallery_at(size: int, generator: Generator, real_strangers: Vectors, target: float, fixed: float,
               strangers: int, genuine: int, seed: int) -> SizeRow:
    """One gallery of ``size`` synthetic identities (one face each): its own calibration, then strangers
    and genuine probes at the derived threshold and at ``fixed``."""
    rng = np.random.default_rng(seed)
    centres = generator.identities(size, rng)
    enrolled = generator.faces(centres, rng)
    began = time.perf_counter()
    calibration = measured_calibration(np.arange(size, dtype=np.int64), enrolled)
    measure_s = time.perf_counter() - began
    info = CollectionInfo(1, "bench", "synthetic", enrolled.shape[1], fixed, True, datetime.now(UTC), FPIR,
                          target, calibration)
    decision = decide(info, size, {})
    index = faiss.IndexFlatIP(enrolled.shape[1])
    index.add(enrolled)
    synthetic, _ = _best(index, generator.faces(generator.identities(strangers, rng), rng))
    real, _ = _best(index, real_strangers)
    asked = rng.choice(size, min(genuine, size), replace=False)
    scores, found = _best(index, generator.faces(centres[asked], rng))

    def matched(best: NDArray[np.float32], at: float) -> tuple[int, int]:
        return int((best >= at).sum()), len(best)

    def missed(at: float) -> tuple[int, int]:
        return int(((found != asked) | (scores < at)).sum()), len(asked)

    t = decision.threshold
    return SizeRow(size, t, decision.basis, matched(synthetic, t), matched(real, t), missed(t),
                   matched(synthetic, fixed), matched(real, fixed), missed(fixed), measure_s)


def calibration_cpu(size: int, generator: Generator, target: float, k: int = 5, rounds: int = 2000,
                    seed: int = 1) -> dict[str, float]:
    """The calibration's CPU per identify (the decision and a confidence per candidate, as the gateway
    makes them) beside one exact search of a gallery of ``size`` faces, in this process."""
    rng = np.random.default_rng(seed)
    faces = generator.faces(generator.identities(size, rng), rng)
    sample = faces[rng.choice(size, min(size, 20_000), replace=False)]
    measured = measured_calibration(np.arange(len(sample), dtype=np.int64), sample)
    info = CollectionInfo(1, "bench", "synthetic", faces.shape[1], 0.363, True, datetime.now(UTC), FPIR,
                          target, measured)
    index = faiss.IndexFlatIP(faces.shape[1])
    index.add(faces)
    queries = generator.faces(generator.identities(64, rng), rng)
    began = time.process_time()
    for query in queries:
        index.search(query[None], k)
    search_us = (time.process_time() - began) / len(queries) * 1e6
    scores = np.sort(rng.uniform(0.0, 0.8, k))
    began = time.process_time()
    for number in range(rounds):  # a new size every round: the decision is derived, not remembered
        decision = decide(info, size + number, {})
        for score in scores:
            decision.confidence(float(score))
    calibration_us = (time.process_time() - began) / rounds * 1e6
    return {"faces": size, "search_us": round(search_us, 1), "calibration_us": round(calibration_us, 1),
            "share": round(calibration_us / search_us, 4)}


# --- the command line ---------------------------------------------------------------------------------


def _rate(counts: tuple[int, int]) -> str:
    k, n = counts
    return f"{100 * k / n:.2f} % ({k}/{n})" if n else "—"


def _real(path: Path) -> tuple[Vectors, list[str]]:
    """The faces and their people in an ``evaluate`` embeddings file."""
    data = np.load(path)
    names = [str(x) for x in data["names"]]
    return data["vectors"].astype(np.float32), [names[i] for i in data["identities"]]


def write_synthetic(args: argparse.Namespace) -> None:
    faces, labels = _real(args.embeddings)
    generator, _ = fit_generator(faces, labels)
    rng = np.random.default_rng(7)
    centres = generator.identities(args.identities, rng)
    vectors = generator.faces(np.repeat(centres, args.faces, axis=0), rng)
    names = [f"p{i:05d}" for i in range(args.identities)]
    identities = np.repeat(np.arange(args.identities), args.faces)
    model = {"name": "synthetic", "match_threshold": args.fixed, "score_reference": {},
             "folder": f"synthetic ({args.identities} x {args.faces}, fitted to {args.embeddings.name})",
             "failed": []}
    np.savez_compressed(args.out, vectors=vectors, identities=identities, names=np.array(names),
                        paths=np.array([f"{names[i]}/{k:02d}.png" for i in range(args.identities)
                                        for k in range(args.faces)]), model=np.array(json.dumps(model)))


def _split(labels: list[str]) -> tuple[list[int], list[int]]:
    """Real faces split by person, half to fit the generator and half as strangers (a stable hash)."""
    fit = [i for i, p in enumerate(labels) if zlib.crc32(p.encode()) % 2 == 0]
    return fit, [i for i in range(len(labels)) if i not in set(fit)]


def run(args: argparse.Namespace) -> tuple[list[SizeRow], dict[str, Any]]:
    faces, labels = _real(args.embeddings)
    fit_part, stranger_part = _split(labels)
    generator, fit = fit_generator(faces[fit_part], [labels[i] for i in fit_part])
    strangers = faces[stranger_part]
    rows = [gallery_at(size, generator, strangers, args.fpir, args.fixed, args.strangers, args.genuine,
                       seed=size) for size in args.sizes]
    cpu = calibration_cpu(max(args.sizes), generator, args.fpir)
    rng = np.random.default_rng(3)
    imported = generator.faces(generator.identities(args.import_faces, rng), rng)
    began = time.perf_counter()
    measured_calibration(np.arange(args.import_faces, dtype=np.int64), imported)
    refit_s = time.perf_counter() - began
    return rows, {"fit": fit, "rows": [asdict(r) for r in rows], "cpu": cpu,
                  "refit": {"faces": args.import_faces, "seconds": round(refit_s, 2)},
                  "strangers real": len(stranger_part), "fpir": args.fpir, "fixed": args.fixed}


def report(rows: list[SizeRow], result: dict[str, Any], command: str) -> str:
    fit, cpu, refit = result["fit"], result["cpu"], result["refit"]
    columns: list[tuple[str, Any]] = [
        ("identities", "{0.size:,}"), ("fpir threshold", "{0.threshold:.4f}"), ("basis", "{0.basis}"),
        ("FPIR (synthetic strangers)", lambda r: _rate(r.fpir)),
        ("FPIR (real strangers)", lambda r: _rate(r.real_fpir)), ("FNIR", lambda r: _rate(r.fnir)),
        (f"fixed {result['fixed']}: FPIR", lambda r: _rate(r.fixed_fpir)),
        ("fixed: FPIR real", lambda r: _rate(r.fixed_real)), ("fixed: FNIR", lambda r: _rate(r.fixed_fnir)),
        ("calibration measured in", "{0.measure_s:.1f} s")]
    lines = [
        run_header(command, machine_description()), "",
        f"Generator fitted on {fit['identities']} real identities ({fit['impostor pairs']} impostor pairs): "
        f"impostor mean, sd, 99th, 99.9th percentile real {fit['impostor real']}, fitted "
        f"{fit['impostor fitted']}; genuine mean, sd real {fit['genuine real']}, fitted "
        f"{fit['genuine fitted']}. "
        f"Real strangers: {result['strangers real']} faces of the other identities.", "",
        table(rows, columns), "",
        f"Calibration CPU per identify (the decision and 5 confidences): {cpu['calibration_us']} µs, beside "
        f"{cpu['search_us']} µs for one exact search of {cpu['faces']:,} faces: {100 * cpu['share']:.2f} %. "
        f"Measuring the tail again after an import of {refit['faces']:,} faces: {refit['seconds']} s."]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = cli("bench.calibration", __doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    faces = sub.add_parser("faces", help="write the labelled folder of real faces")
    faces.add_argument("--out", type=Path, required=True)
    faces.add_argument("--url", default="127.0.0.1:8001", help="Triton gRPC address")
    synthetic = sub.add_parser("synthetic",
                               help="labelled embeddings from the model fitted to the real faces")
    synthetic.add_argument("--embeddings", type=Path, required=True, help="embeddings.npz of the real faces")
    synthetic.add_argument("--identities", type=int, default=2000)
    synthetic.add_argument("--faces", type=int, default=5, help="faces per identity")
    synthetic.add_argument("--fixed", type=float, default=0.363, help="the model's fixed threshold")
    synthetic.add_argument("--out", type=Path, required=True)
    measure = sub.add_parser("run", help="synthetic galleries fitted to the real faces")
    measure.add_argument("--embeddings", type=Path, required=True, help="embeddings.npz of "
                         "`python -m recognition evaluate --folder <faces> --out DIR`")
    measure.add_argument("--sizes", type=int, nargs="+", default=[100, 10_000, 1_000_000])
    measure.add_argument("--fpir", type=float, default=0.01)
    measure.add_argument("--fixed", type=float, default=0.363, help="the fixed threshold compared with")
    measure.add_argument("--strangers", type=int, default=5000)
    measure.add_argument("--genuine", type=int, default=2000)
    measure.add_argument("--import-faces", type=int, default=100_000)
    measure.add_argument("--json", type=Path, help="raw numbers (docs/benchmarks/runs/)")
    measure.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks" / "calibration.md")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "faces":
        print(json.dumps(build_faces(args.out, args.url), indent=1))
        return 0
    if args.command == "synthetic":
        write_synthetic(args)
        return 0
    rows, result = run(args)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    text = report(rows, result, command_line("bench.calibration", argv))
    write_section(args.out, "calibration", text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
