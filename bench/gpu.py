"""The GPU plan's measurements (docs/gpu-plan.md), with PyTorch standing in for TensorRT.

    python -m bench.gpu bundle --out gpu-bundle                  # here: what the GPU host needs, one folder
    python -m bench.gpu run --bundle gpu-bundle --json gpu.json  # there: PyTorch with CUDA

TensorRT installs neither here nor on the lent GPU host, so the gpu profile's ONNX files run with PyTorch
operations (``export.onnx_torch``) in float32 and float16: the same arithmetic on the same GPU, a floor
for what a plan reaches. ``run`` needs neither Triton nor FAISS. Its parts: *networks*, *precision*
(``export.engine_check``'s plan check), *decode* (nvJPEG against every core), *pipeline* (decode +
``run_pipeline`` in 1 and cores - 2 processes), *gallery* (exact float16 search). ``--device cpu`` runs
the same code on tiny sizes (the tests).
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import multiprocessing as mp
import os
import platform
import shutil
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from bench import gpu_precision
from facecore.pipeline import PipelineSettings
from facecore.processing import decode_sized

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parent.parent
SETTINGS = "settings.json"
DETECTOR_FILE = "detector.onnx"
EMBEDDER_FILE = "embedder.onnx"
PHOTOS = "photos"
PIPELINE_PHOTOS = ("obama.jpg", "t1.jpg")
K = 10
#: Seconds a pipeline worker may take to start (imports, CUDA, the networks) before the run gives up.
STARTUP_SECONDS = 120.0


@dataclass(frozen=True)
class Sizes:
    """How much each part measures; ``tiny`` is what the tests run on a CPU."""

    embedder_batches: tuple[int, ...] = (1, 8, 32, 64, 128, 256)
    detector_batches: tuple[int, ...] = (1, 8, 32, 64)
    seconds: float = 0.5  # each timed point, after a warm-up
    decode_batch: int = 32
    pipeline_seconds: float = 6.0
    pipeline_processes: tuple[int, ...] = (1, 0)  # 0: the cores minus 2 (the gpu profile's instances)
    gallery_sizes: tuple[int, ...] = (1_000_000, 10_000_000)
    gallery_dims: tuple[int, ...] = (128, 512)
    gallery_blocks: tuple[int, ...] = (1, 32, 256)
    recall_queries: int = 256

    @classmethod
    def tiny(cls) -> Sizes:
        return cls((1, 2), (1,), 0.05, 2, 0.5, (2,), (2000,), (128,), (1, 4), 8)


@dataclass
class Report:
    machine: dict[str, str] = field(default_factory=dict)
    networks: list[dict[str, Any]] = field(default_factory=list)
    precision: list[dict[str, Any]] = field(default_factory=list)
    decode: list[dict[str, Any]] = field(default_factory=list)
    pipeline: list[dict[str, Any]] = field(default_factory=list)
    gallery: list[dict[str, Any]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def bundle(repository: Path, photos: Path, out: Path) -> Path:
    """Copy the gpu profile's two ONNX files, ``face_pipeline``'s settings and the photos into ``out``."""
    from export.served import latest_version, read_config

    if not (repository / "face_pipeline" / "config.pbtxt").is_file():
        raise FileNotFoundError(f"no gpu model repository at {repository}: run `python -m export defaults`")
    if not (photos / "obama.jpg").is_file():
        raise FileNotFoundError(f"no test photos in {photos}: run `python -m export photos --out {photos}`")
    pipeline = read_config(repository / "face_pipeline")
    parameters = {k: v.string_value for k, v in pipeline.parameters.items()}
    settings = PipelineSettings.from_parameters(parameters)
    out.mkdir(parents=True, exist_ok=True)
    for name, target in ((settings.detector_model, DETECTOR_FILE), (settings.embedder_model, EMBEDDER_FILE)):
        shutil.copyfile(latest_version(repository / name) / "model.onnx", out / target)
    (out / SETTINGS).write_text(json.dumps(parameters, indent=1) + "\n")
    (out / PHOTOS).mkdir(exist_ok=True)
    for path in sorted(photos.glob("*")):
        if path.is_file() and path.suffix in (".jpg", ".png"):
            shutil.copyfile(path, out / PHOTOS / path.name)
    return out


def load_settings(folder: Path) -> PipelineSettings:
    if not (folder / SETTINGS).is_file():
        raise FileNotFoundError(f"{folder} is not a bundle (no {SETTINGS}): write one with "
                                "`python -m bench.gpu bundle --out FOLDER`")
    return PipelineSettings.from_parameters(json.loads((folder / SETTINGS).read_text()))


def _torch() -> Any:
    import torch

    return torch


def precisions(device: str) -> list[tuple[str, bool]]:
    """(name, reduced): float16 only on a GPU (most CPUs emulate it; the tests run on a CPU)."""
    return [("float32", False), ("float16", True)] if device.startswith("cuda") else [("float32", False)]


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        _torch().cuda.synchronize()


def _timed(call: Callable[[], Any], device: str, seconds: float) -> float:
    """Median seconds per call: a warm-up, then three rounds of about ``seconds`` / 3 each."""
    for _ in range(3):
        call()
    synchronize(device)
    start = time.perf_counter()
    call()
    synchronize(device)
    once = max(time.perf_counter() - start, 1e-6)
    reps = max(1, int(seconds / 3 / once))
    rounds = []
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(reps):
            call()
        synchronize(device)
        rounds.append((time.perf_counter() - start) / reps)
    return statistics.median(rounds)


def measure_networks(folder: Path, settings: PipelineSettings, device: str, sizes: Sizes, cores: int
                     ) -> list[dict[str, Any]]:
    from export.onnx_torch import OnnxModule, cuda_graph, reduced_dtype

    torch = _torch()
    torch.backends.cudnn.benchmark = True
    rows: list[dict[str, Any]] = []
    for role, spec, batches, file in (("detector", settings.detector, sizes.detector_batches, DETECTOR_FILE),
                                      ("embedder", settings.embedder, sizes.embedder_batches, EMBEDDER_FILE)):
        module = OnnxModule(folder / file, device)
        width, height = spec.input_size
        for batch, (precision, reduced) in itertools.product(batches, precisions(device)):
            x = (torch.randint(0, 256, (batch, height, width, 3), dtype=torch.uint8, device=device)
                 if role == "detector" else torch.rand((batch, 3, height, width), device=device) * 255)

            def call(m: Any = module, x: Any = x, reduced: bool = reduced) -> Any:
                with torch.inference_mode(), torch.autocast(device.split(":")[0], dtype=reduced_dtype(device),
                                                            enabled=reduced, cache_enabled=False):
                    return m(x)

            for how in ("eager", "cuda graph") if device.startswith("cuda") else ("eager",):
                row = {"network": role, "precision": precision, "run": how, "batch": batch}
                try:
                    run = call if how == "eager" else cuda_graph(call).replay
                    seconds = _timed(run, device, sizes.seconds)
                except RuntimeError as exc:  # a capture that fails loses that row, not the part
                    rows.append(row | {"error": str(exc)[:300]})
                    continue
                rows.append(row | {"input": f"{width}x{height}", "ms_per_batch": seconds * 1000,
                                   "per_second": batch / seconds})
                log.info("%s %s %s batch %d: %.3f ms", role, precision, how, batch, seconds * 1000)
        del module
    return rows


def _decode_many(args: tuple[bytes, int, int, int]) -> int:
    import cv2

    data, max_pixels, min_side, count = args
    cv2.setNumThreads(1)
    for _ in range(count):
        decode_sized(data, max_pixels, min_side)
    return count


def measure_decode(folder: Path, settings: PipelineSettings, device: str, sizes: Sizes, cores: int
                   ) -> list[dict[str, Any]]:
    """``face_pipeline``'s decode (full size and reduced) on one core and on every core; nvJPEG (a GPU)."""
    rows: list[dict[str, Any]] = []
    gpu = device.startswith("cuda")
    if gpu:
        from torchvision.io import decode_jpeg
    with ProcessPoolExecutor(cores, mp_context=mp.get_context("spawn")) as pool:
        list(pool.map(_decode_many, [(b"", 0, 0, 0)] * cores))  # start the workers before timing
        for path in sorted((folder / PHOTOS).glob("*.jpg")):
            data = path.read_bytes()
            for min_side in sorted({0, settings.decode_min_side}):
                image, size = decode_sized(data, settings.max_pixels, min_side)
                one = _timed(partial(decode_sized, data, settings.max_pixels, min_side), "cpu", sizes.seconds)
                start = time.perf_counter()
                done = sum(pool.map(_decode_many, [(data, settings.max_pixels, min_side,
                                                    max(1, int(sizes.seconds / one)))] * cores))
                rows.append({"photo": path.name, "size": f"{size[0]}x{size[1]}", "cores": cores,
                             "decoded": f"{image.shape[1]}x{image.shape[0]}",
                             "decoder": "cpu (facecore decode_sized)",
                             "ms_one": one * 1000, "per_second_one_core": 1 / one,
                             "per_second_all_cores": done / (time.perf_counter() - start)})
            for batch in (1, sizes.decode_batch) if gpu else ():
                row = {"photo": path.name, "batch": batch,
                       "decoder": "nvjpeg (torchvision decode_jpeg, device cuda)"}
                encoded = [_torch().frombuffer(bytearray(data), dtype=_torch().uint8)] * batch
                try:
                    seconds = _timed(partial(decode_jpeg, encoded, device=device), device, sizes.seconds)
                except RuntimeError as exc:  # nvJPEG refusing one photo loses that row only
                    rows.append(row | {"error": str(exc)[:300]})
                    continue
                rows.append(row | {"ms_per_batch": seconds * 1000, "per_second": batch / seconds})
    return rows


def _pipeline_worker(folder: str, device: str, graphs: bool, names: Sequence[str], seconds: float,
                     barrier: Any, results: Any) -> None:
    import cv2

    from export.engine_check import _detector, _embedder
    from export.onnx_torch import torch_runner
    from facecore.pipeline import run_pipeline

    _torch().set_num_threads(1)
    cv2.setNumThreads(1)
    path = Path(folder)
    settings = load_settings(path)
    reduced = precisions(device)[-1][1]
    detect = _detector(torch_runner(path / DETECTOR_FILE, settings.detector.output_names, device, reduced,
                                    graphs))
    embed = _embedder(torch_runner(path / EMBEDDER_FILE, settings.embedder.output_names, device, reduced,
                                   graphs))

    def request(data: bytes) -> int:
        image, size = decode_sized(data, settings.max_pixels, settings.decode_min_side)
        sizes = None if (image.shape[1], image.shape[0]) == size else [size]
        faces = run_pipeline([image], [settings.default_options], settings, detect, embed, sizes)
        return len(faces[0])

    photos = {name: (path / PHOTOS / name).read_bytes() for name in names}
    found = {name: [request(data) for _ in range(3)][-1] for name, data in photos.items()}
    for name, data in photos.items():
        barrier.wait()
        latencies = []
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            start = time.perf_counter()
            request(data)
            latencies.append(time.perf_counter() - start)
        results.put((name, found[name], len(latencies), statistics.median(latencies)))


def measure_pipeline(folder: Path, settings: PipelineSettings, device: str, sizes: Sizes, cores: int
                     ) -> list[dict[str, Any]]:
    rows = []
    context = mp.get_context("spawn")
    names = [n for n in PIPELINE_PHOTOS if (folder / PHOTOS / n).exists()]
    runs = [("eager", False)] + ([("cuda graphs", True)] if device.startswith("cuda") else [])
    for (how, graphs), wanted in itertools.product(runs, sizes.pipeline_processes):
        processes = wanted or max(1, cores - 2)
        barrier, results = context.Barrier(processes + 1), context.Queue()
        workers = [context.Process(target=_pipeline_worker, args=(
                       str(folder), device, graphs, names, sizes.pipeline_seconds, barrier, results))
                   for _ in range(processes)]
        for w in workers:
            w.start()
        try:
            for name in names:
                barrier.wait(timeout=STARTUP_SECONDS)  # broken (an error) if a worker died before it
                wait = sizes.pipeline_seconds + STARTUP_SECONDS
                got = [results.get(timeout=wait) for _ in range(processes)]
                rows.append({"photo": name, "faces": got[0][1], "processes": processes, "networks": how,
                             "photos_per_second": sum(g[2] for g in got) / sizes.pipeline_seconds,
                             "median_ms": statistics.median(g[3] for g in got) * 1000})
                log.info("pipeline %s x%d, %s: %.0f photos/s, median %.1f ms", name, processes, how,
                         rows[-1]["photos_per_second"], rows[-1]["median_ms"])
        finally:
            for w in workers:
                w.join(timeout=10)
                if w.is_alive():
                    w.terminate()
    return rows


def measure_gallery(folder: Path, settings: PipelineSettings, device: str, sizes: Sizes, cores: int
                    ) -> list[dict[str, Any]]:
    """Exact top-10 search in the reduced precision over random unit vectors, and its recall@10 against
    float32 (no TF32) on the smallest size."""
    from export.onnx_torch import reduced_dtype

    torch, dtype, rows = _torch(), reduced_dtype(device), []
    generator = torch.Generator(device=device).manual_seed(7)
    for dim, count in itertools.product(sizes.gallery_dims, sizes.gallery_sizes):
        faces = torch.randn((count, dim), generator=generator, device=device, dtype=dtype)
        faces /= faces.float().norm(dim=1, keepdim=True).to(dtype)
        picked = torch.randint(0, count, (max(*sizes.gallery_blocks, sizes.recall_queries),),
                               generator=generator, device=device)
        noise = torch.randn((len(picked), dim), generator=generator, device=device) / dim ** 0.5
        queries = faces[picked].float() + 0.6 * noise
        queries = (queries / queries.norm(dim=1, keepdim=True)).to(dtype)
        recall = None
        if count == min(sizes.gallery_sizes):
            allowed, torch.backends.cuda.matmul.allow_tf32 = torch.backends.cuda.matmul.allow_tf32, False
            exact = torch.topk(queries[:sizes.recall_queries].float() @ faces.float().T, K, dim=1).indices
            torch.backends.cuda.matmul.allow_tf32 = allowed
            got = torch.topk(queries[:sizes.recall_queries] @ faces.T, K, dim=1).indices
            recall = sum(len(set(a) & set(b)) for a, b in zip(exact.tolist(), got.tolist(), strict=True)) / (
                K * len(exact))
        for block in sizes.gallery_blocks:
            seconds = _timed(partial(_top, queries[:block], faces), device, sizes.seconds)
            rows.append({"faces": count, "dim": dim, "dtype": str(dtype).removeprefix("torch."),
                         "block": block, "ms_per_block": seconds * 1000,
                         "queries_per_second": block / seconds,
                         "bytes_per_million": dim * faces.element_size() * 1_000_000,
                         "recall_at_10_vs_float32": recall})
        del faces, queries
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    return rows


def _top(queries: Any, faces: Any) -> Any:
    return _torch().topk(queries @ faces.T, K, dim=1)


def machine(device: str) -> dict[str, str]:
    torch = _torch()
    import cv2

    from facecore import jpeg
    from facecore.runtimes import cpu_model

    info = {"python": platform.python_version(), "torch": torch.__version__, "numpy": np.__version__,
            "opencv": cv2.__version__, "cpus": str(len(os.sched_getaffinity(0))), "cpu": cpu_model(),
            "jpeg": f"simplejpeg {jpeg.turbo.__version__}" if jpeg.turbo else "OpenCV (simplejpeg absent)"}
    if device.startswith("cuda"):
        props = torch.cuda.get_device_properties(0)
        info |= {"gpu": props.name, "gpu_memory_gib": f"{props.total_memory / 2**30:.0f}",
                 "cuda": str(torch.version.cuda), "cudnn": str(torch.backends.cudnn.version())}
    return info


def run(folder: Path, device: str, sizes: Sizes, parts: Sequence[str], json_path: Path | None) -> Report:
    """Every part in ``parts``; a part that fails is recorded in ``errors`` and the others still run."""
    report, settings = Report(machine=machine(device)), load_settings(folder)
    cores = len(os.sched_getaffinity(0))
    for part in parts:
        started = time.perf_counter()
        try:
            setattr(report, part, PARTS[part](folder, settings, device, sizes, cores))
        except Exception as exc:
            log.exception("part %s failed", part)
            report.errors.append(f"{part}: {type(exc).__name__}: {exc}")
        log.info("part %s: %.1f s", part, time.perf_counter() - started)
        if json_path is not None:  # after every part: a run cut short keeps what it measured
            json_path.write_text(json.dumps(asdict(report), indent=1) + "\n")
    return report


#: Each part: (bundle, settings, device, sizes, cores) -> its rows.
PARTS: dict[str, Callable[[Path, PipelineSettings, str, Sizes, int], list[dict[str, Any]]]] = {
    "networks": measure_networks,
    "precision": lambda folder, settings, device, _sizes, _cores: gpu_precision.check(
        folder / DETECTOR_FILE, folder / EMBEDDER_FILE, folder / PHOTOS, settings, device),
    "decode": measure_decode, "pipeline": measure_pipeline, "gallery": measure_gallery}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("bundle", help="copy the gpu profile's networks, settings and photos into one folder")
    b.add_argument("--repository", type=Path, default=ROOT / "model_repository" / "gpu")
    b.add_argument("--photos", type=Path, default=ROOT / "artifacts" / "photos")
    b.add_argument("--out", type=Path, required=True)
    r = sub.add_parser("run", help="measure (needs PyTorch; CUDA and torchvision for the GPU figures)")
    r.add_argument("--bundle", type=Path, required=True, help="a folder written by `bundle`")
    r.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    r.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    r.add_argument("--tiny", action="store_true", help="tiny sizes (what the tests run)")
    r.add_argument("--json", type=Path, help="write the figures here (after every part)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    try:
        if args.command == "bundle":
            print(bundle(args.repository, args.photos, args.out))
            return 0
        load_settings(args.bundle)
    except FileNotFoundError as exc:
        raise SystemExit(str(exc)) from exc
    if args.device.startswith("cuda") and not _torch().cuda.is_available():
        raise SystemExit("no CUDA device visible to PyTorch: run with --device cpu, or on a GPU host")
    report = run(args.bundle, args.device, Sizes.tiny() if args.tiny else Sizes(), args.parts, args.json)
    print(json.dumps(asdict(report), indent=1))
    return 1 if report.errors else 0


if __name__ == "__main__":
    raise SystemExit(main())
