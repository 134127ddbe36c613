"""``face_pipeline`` latency and throughput over gRPC, for a 1-face and a 6-face photo.

    python -m bench.pipeline                 # starts the bundled Triton on free ports
    python -m bench.pipeline --url 127.0.0.1:8001 --seconds 30

Prints a Markdown table (and writes JSON with --json): latency percentiles at concurrency 1,
throughput at concurrency 8, and Triton's own statistics (average batch size per model, queue time per
request, compute time per execution from the batch statistics; ``bench.core.triton.statistics_delta``).
``python -m bench`` runs the whole comparison (ceiling, naive baseline, REST and gRPC, memory).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any

from bench.core.inputs import REPOSITORY, photo_paths
from bench.core.load import closed_loop
from bench.core.triton import MODELS, model_statistics, statistics_delta, triton_url
from facecore.client import PipelineClient

PHOTOS = {"1 face (obama.jpg, 910x1137)": "obama.jpg", "6 faces (t1.jpg, 1280x886)": "t1.jpg"}


def measure(url: str, payload: bytes, seconds: float, concurrency: int) -> dict[str, Any]:
    client = PipelineClient(url)  # gRPC channels are thread-safe and multiplex concurrent calls

    def send() -> object:
        return client.infer(payload)

    before = model_statistics(url)
    result = closed_loop(send, concurrency, seconds)
    after = model_statistics(url)
    client.close()
    return {**result.row(), "triton": statistics_delta(before, after)}


def report(results: dict[str, dict[str, Any]]) -> str:
    lines = ["| photo | concurrency | images/s | p50 ms | p90 ms | p99 ms | errors "
             "| avg batch (pipeline / detector / embedder) |",
             "|---|---|---|---|---|---|---|---|"]
    for photo, runs in results.items():
        for run in runs.values():
            batches = " / ".join(f"{run['triton'][m]['avg_batch']:.2f}" for m in MODELS)
            lines.append(f"| {photo} | {run['concurrency']} | {run['throughput_per_s']} | {run['p50_ms']} | "
                         f"{run['p90_ms']} | {run['p99_ms']} | {run['errors']} | {batches} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.pipeline", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", help="gRPC address of a running Triton (default: start the bundled one)")
    parser.add_argument("--repository", type=Path, default=REPOSITORY)
    parser.add_argument("--seconds", type=float, default=20.0, help="duration of each measurement")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    photos = photo_paths()
    with triton_url(args.url, args.repository) as url:
        results = {
            label: {
                str(c): measure(url, photos[name].read_bytes(), args.seconds, c) for c in args.concurrency
            }
            for label, name in PHOTOS.items()
        }
    print(report(results))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
