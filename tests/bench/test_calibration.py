"""bench/calibration.py: the generator fitted to real faces reproduces their score statistics, and a gallery
decided by its own calibration keeps strangers' matches near the target where a fixed threshold does not.
Small sizes: the published run (docs/calibration.md) goes to a million identities."""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import pytest

from bench.calibration import fit_generator, gallery_at, report, run

DIM = 128


def real_like(rng: np.random.Generator, people: int = 40, photos: int = 2) -> tuple[np.ndarray, list[str]]:
    """Stand-in "real" faces: identity centres around a common mean, two noisy faces each."""
    mean = rng.standard_normal(DIM) * 0.05
    centres = mean + rng.standard_normal((people, DIM)) / np.sqrt(DIM)
    noise = 0.5 * rng.standard_normal((people * photos, DIM)) / np.sqrt(DIM)
    faces = np.repeat(centres, photos, axis=0) + noise
    faces /= np.linalg.norm(faces, axis=1, keepdims=True)
    return faces.astype(np.float32), [f"p{i}" for i in range(people) for _ in range(photos)]


def test_the_generator_reproduces_the_real_score_statistics() -> None:
    faces, labels = real_like(np.random.default_rng(1))
    _, fit = fit_generator(faces, labels)
    real, fitted = np.array(fit["impostor real"]), np.array(fit["impostor fitted"])
    assert np.abs(real[:2] - fitted[:2]).max() < 0.03  # mean and sd of impostor scores
    assert abs(fit["genuine real"][0] - fit["genuine fitted"][0]) < 0.05


def test_a_gallery_decided_at_a_target_fpir_keeps_strangers_near_it() -> None:
    faces, labels = real_like(np.random.default_rng(2))
    generator, _ = fit_generator(faces, labels)
    row = gallery_at(2_000, generator, faces[:10], target=0.01, fixed=0.1, strangers=4_000, genuine=500,
                     seed=3)
    matched, asked = row.fpir
    assert row.basis == "collection" and 0.003 < matched / asked < 0.03, row
    assert row.fixed_fpir[0] / row.fixed_fpir[1] > 0.2  # a threshold fixed low lets many strangers through
    assert row.threshold > 0.1


def test_the_run_writes_its_table(tmp_path: Path) -> None:
    faces, labels = real_like(np.random.default_rng(4))
    names = sorted(set(labels))
    np.savez(tmp_path / "embeddings.npz", vectors=faces, names=np.array(names),
             identities=np.array([names.index(p) for p in labels]))
    args = argparse.Namespace(embeddings=tmp_path / "embeddings.npz", sizes=[200, 500], fpir=0.01,
                              fixed=0.363, strangers=300, genuine=100, import_faces=2_000)
    rows, result = run(args)
    text = report(rows, result, "python -m bench.calibration run --sizes 200 500")
    assert [r.size for r in rows] == [200, 500] and "| 500 |" in text and result["refit"]["faces"] == 2_000
    with pytest.raises(SystemExit):
        from bench.calibration import main

        main(["run"])  # --embeddings is required
