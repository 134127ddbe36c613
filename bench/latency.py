"""Latency at concurrency 1, paired: the ceiling's single image in this process, gRPC ``face_pipeline``
and REST ``identify``, one call of each in turn, round after round, so that the machine's drift falls on
all three alike (measured minutes apart, they differ by it as much as by the milliseconds between them).
A short pause separates the calls: a runtime's threads spin for a moment after a call, and that moment
must not fall on the next call, which belongs to another process.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial

from bench.ceiling import process
from bench.core.inputs import ServedModels
from bench.stack import GRPC, MAX_FACES, REST, Stack, identify_sender
from facecore.client import PipelineClient

ROUNDS = 200
PAUSE_S = 0.03
WARMUP = 5
THREADS = 2
CEILING = "ceiling"


@dataclass
class PairedLatency:
    photo: str
    rounds: int
    threads: int  # the ceiling's intra-op threads per network
    pause_ms: float
    ceiling_ms: float  # medians over the rounds
    grpc_ms: float
    rest_ms: float
    grpc_paired: float  # the median over the rounds of gRPC / ceiling in the same round
    rest_paired: float

    def p50_ms(self, target: str) -> float:
        return {GRPC: self.grpc_ms, REST: self.rest_ms}[target]


def alternate(calls: Mapping[str, Callable[[], object]], rounds: int, pause_s: float = PAUSE_S,
              warmup: int = WARMUP) -> dict[str, list[float]]:
    """Every call once per round, in order, ``pause_s`` before each; each call's milliseconds per round
    (``warmup`` rounds first, not kept)."""
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, not {rounds}")
    times: dict[str, list[float]] = {name: [] for name in calls}
    for index in range(warmup + rounds):
        for name, call in calls.items():
            time.sleep(pause_s)
            began = time.perf_counter()
            call()
            if index >= warmup:
                times[name].append(1000 * (time.perf_counter() - began))
    return times


def summarize(photo: str, times: Mapping[str, list[float]], threads: int, pause_s: float) -> PairedLatency:
    ceiling = times[CEILING]

    def paired(name: str) -> float:
        return statistics.median(a / b for a, b in zip(times[name], ceiling, strict=True))

    return PairedLatency(photo, len(ceiling), threads, 1000 * pause_s, statistics.median(ceiling),
                         statistics.median(times[GRPC]), statistics.median(times[REST]), paired(GRPC),
                         paired(REST))


def measure(running: Stack, models: ServedModels, photos: Mapping[str, bytes], threads: Mapping[str, int],
            rounds: int = ROUNDS, pause_s: float = PAUSE_S) -> list[PairedLatency]:
    """Each photo's paired rounds (``threads``: the ceiling's best thread count per photo)."""
    settings = models.settings
    out = []
    client = PipelineClient(running.triton_grpc, timeout_s=300)
    try:
        for photo, data in photos.items():
            count = threads.get(photo, THREADS)
            detector, embedder = models.detector(count), models.embedder(count)
            with identify_sender(running, photo, data) as sender:
                calls: dict[str, Callable[[], object]] = {
                    CEILING: partial(process, [data], settings, detector, embedder),
                    GRPC: partial(client.infer, data, max_faces=MAX_FACES), REST: sender}
                out.append(summarize(photo, alternate(calls, rounds, pause_s), count, pause_s))
    finally:
        client.close()
    return out
