"""The wording of the serving report, in one place.

Every sentence, label and heading ``python -m bench`` writes into ``docs/benchmarks/README.md`` is a
``str.format`` template here, with named fields; ``bench/report_targets.py`` and ``bench/report.py`` decide
which ones apply and fill them with this run's values (``say``). Change the wording here; the numbers come
from the results. ``tests/test_bench_suite.py`` re-renders the recorded report from its ``results.json``.
"""

from __future__ import annotations


def say(template: str, **values: object) -> str:
    """``template`` filled with ``values`` (a missing field raises ``KeyError``)."""
    return template.format(**values)


# --- values -------------------------------------------------------------------------------------------
IMAGES_PER_S = "{value:.1f} images/s"
IMAGES_PER_S_OF = "{value:.1f} images/s ({target})"
IMAGES_PER_S_AT = "{value:.1f} images/s at {concurrency}"
IMAGES_PER_S_AT_OF = "{value:.1f} images/s at {concurrency} ({target})"
CEILING_IMAGES_PER_S = "ceiling {value:.1f} images/s"
MS = "{value:.1f} ms"

# --- ratios (both sides measured in the same run) -----------------------------------------------------
RATIO_RUNTIMES = "ceiling on the served runtime / ceiling on ONNX Runtime, {photo}"
RATIO_VS_CEILING = "{target} / ceiling, {photo}, concurrency {c}"
RATIO_VS = "{target} / {baseline}, {photo}, concurrency {c}"
RATIO_BEST_OF_EACH = "{target} / {baseline}, {photo}, best concurrency of each"
RATIO_WORK_REDUCTIONS = "{served} / {plain}, {photo}, concurrency {c} (the work reductions alone)"
RATIO_GATEWAY = "{rest} / {grpc}, {photo}, concurrency {c} (the gateway's cost)"
RATIO_LATENCY = "{target} p50 at concurrency 1 / ceiling single image, {photo}"
RATIO_LATENCY_PAIRED = "{target} p50 at concurrency 1 / ceiling single image, {photo}, paired rounds"

# --- targets: names and what was measured -------------------------------------------------------------
PASS, SHORT, NOT_MEASURED = "pass", "falls short", "not measured"
NOT_IN_RUN = "not part of this run"
BASELINE_SERVED = ("the naive baseline serving what face_pipeline serves, on the same runtime (same work: "
                   "measures serving overhead)")
BASELINE_PLAIN = ("the plain naive baseline (ONNX Runtime, fixed 640x640 float detector input, SFace with "
                  "PReLU: beat the plain approach by doing less work on a faster runtime)")
TARGET_RUNTIME = ("in-process ceiling on the served runtime >= {factor}x the ONNX Runtime ceiling, same "
                  "files and settings ({photo})")
MEASURED_RUNTIME = "{served:.1f} ({runtime}) / {ort:.1f} images/s = {ratio:.2f}x"
TARGET_VS_CEILING = ("REST identify throughput at concurrency {c} >= {share}x the in-process ceiling of the "
                     "same runtime ({photo})")
MEASURED_VS_CEILING = "{rest:.1f} / {ceiling:.1f} images/s = {share:.2f}x ({runtime})"
TARGET_VS_BASELINE = "REST identify throughput at concurrency {c} >= {factor}x {baseline} ({photo})"
MEASURED_VS_BASELINE = "{rest:.1f} / {naive:.1f} images/s = {ratio:.2f}x ({target}; {photo}; same run)"
TARGET_HOLDS = ("REST identify throughput at concurrency {c} >= {share:.0%} of its best concurrency "
                "({photo})")
MEASURED_HOLDS = "{high:.1f} / {top:.1f} images/s (at {c}) = {share:.0%}"
MEASURED_HOLDS_ALTERNATING = ("{share:.0%}: concurrency {high} against {c} in {rounds} alternating rounds of "
                              "{seconds:g} s each ({shares}; the sweep alone: {sweep})")
TARGET_TAIL = "REST identify p99 <= {factor:g}x p50 at concurrency {c} ({photo})"
MEASURED_TAIL = "{p99:.0f} / {p50:.0f} ms = {ratio:.2f}x"
TARGET_TRITON_RSS = ("Triton (server + Python-backend stubs) resident memory (PSS) <= {limit:g} GiB at "
                     "concurrency {c}")
MEASURED_TRITON_RSS = "{mib:.0f} MiB at most ({where})"
MEMORY_RUN = "memory run, {minutes:g} min"
MEMORY_RUN_SHAPES = "memory run, {minutes:g} min, the photo at {shapes} aspect ratios"
TARGET_GATEWAY_CPU = "gateway CPU per identify at concurrency {c} <= {limit:g} ms ({photo})"
MEASURED_GATEWAY_CPU = "{ms:.1f} ms (gateway process CPU seconds / {requests} requests)"
TARGET_OUTSIDE_TRITON = ("face_pipeline time outside the two models <= 3 ms per 1-face image (Triton "
                         "statistics, gRPC, concurrency {c})")
TARGET_OUTSIDE_SPLIT = ("face_pipeline steps outside the two models <= 3 ms per 1-face image (in-process "
                        "timer split)")
MEASURED_SPLIT = "{value:.1f} ms ({threads} thread(s))"
TARGET_LATENCY = "{target} p50 latency at concurrency 1 <= 1.3x the ceiling's single-image time (1 face)"
MEASURED_LATENCY = "{p50:.1f} / {single:.1f} ms = {ratio:.2f}x"
MEASURED_LATENCY_PAIRED = ("{p50:.1f} / {single:.1f} ms = {ratio:.2f}x ({rounds} paired rounds, the two "
                           "calls in turn; the median of each round's ratio {paired:.2f}x)")
MEMORY_LABELS = {"gateway": "gateway", "triton": "Triton (server + Python-backend stubs)"}
TARGET_MEMORY = ("{label} resident memory flat (+-{pct:g} %) across the memory run (REST identify, "
                 "concurrency {c}, {minutes} min)")
MEASURED_MEMORY = "{start:.0f} -> {end:.0f} MiB, largest deviation {deviation:.1f} %"

# --- targets: why one falls short ---------------------------------------------------------------------
CPU_LINE = "{total:.0f} ms CPU per image ({parts})"
CPU_PART = "{name} {ms:.0f}"
LOAD_CLIENT = "load client"
WHY_THROUGHPUT = ("{target} cost {cpu_line}; {reference_name} cost {reference_cpu:.0f} ms CPU per image "
                  "({reference:.1f} images/s). With {cores} cores busy, throughput is about {cores} x 1000 / "
                  "CPU ms per image (here {bound:.1f} images/s)")
WHY_CONSUMERS = "; the largest Triton consumers: {consumers}"
CONSUMER = "{name} {ms:.0f} ms"
WHY_LOAD_CLIENT = "; the load generator runs on the same cores and takes {share:.0%} of that CPU"
WHY_ABOVE_CEILING = (" {factor}x this baseline is {needed:.1f} images/s, above the in-process ceiling with "
                     "the served settings ({ceiling:.1f} images/s), so no server on this machine reaches "
                     "it: on CPU cores there is no idle accelerator for batching to fill.")
WHY_REDUCTIONS_ALONE = (" The work reductions alone make the naive app {speedup:.2f}x faster ({served_name} "
                        "{served:.1f} images/s).")
WHY_OUTSIDE_TRITON = ("pipeline compute {compute:.1f} ms per image minus {models:.1f} ms of detector + "
                      "embedder requests")
WHY_TRITON_OWN = ("; in-process the same steps take {inprocess:.1f} ms ({steps}), so {own:.1f} ms are "
                  "Triton's own: BLS round trips to two models, tensor copies through shared memory between"
                  " the stub processes, the Python-backend stub's request/response handling (and, above "
                  "concurrency 1, CPU contention with the other stubs)")
STEP = "{name} {ms:.1f} ms"
WHY_LARGEST_STEPS = "largest steps: {steps}."
WHY_CEILING_SINGLE = "the ceiling's single image is {single:.1f} ms"
WHY_QUEUES = ("Triton queues add {queue:.1f} ms (dynamic-batching delays of face_pipeline, face_detector and "
              "face_embedder, which wait for a fuller batch even when alone)")
WHY_PIPELINE_OUTSIDE = ("face_pipeline spends {outside:.1f} ms outside the networks (in-process: "
                        "{inprocess:.1f} ms)")
WHY_NETWORKS = "the networks take {stubs:.1f} ms in the stubs vs {inprocess:.1f} ms in-process"
WHY_IN_PROCESS_LAYOUT = ("the served layout runs both networks inside face_pipeline (in_process), so "
                         "Triton's statistics cannot tell its own time from the networks'; the in-process "
                         "split below measures the same steps.")
WHY_GATEWAY = "the gateway (HTTP, multipart, gallery search, JSON) adds {extra:.1f} ms over gRPC"
WHY_GATEWAY_NOISE = ("REST identify's p50 ({rest:.1f} ms) is below gRPC face_pipeline's ({grpc:.1f} ms) "
                     "in this run: the gateway's own time is within the runs' noise here (its CPU per "
                     "request is in the gateway CPU target)")
WHY_RUNTIME = ("single image {single:.1f} vs {ort_single:.1f} ms on ONNX Runtime: the two networks "
               "{models:.1f} vs {ort_models:.1f} ms, everything else {outside:.1f} vs {ort_outside:.1f} ms "
               "(decode, letterbox, NMS, alignment: the same work on either runtime, so it caps the ratio).")
WHY_HOLDS = ("at that concurrency p50 {p50:.0f} ms, p99 {p99:.0f} ms, {errors} errors, Triton {rss:.0f} MiB: "
             "the requests queue up behind a saturated CPU instead of being shed.")
WHY_TAIL = ("p90 {p90:.0f} ms over {requests} requests in {seconds:.0f} s: a few requests wait behind whole "
            "batches (short runs also make p99 rest on a handful of requests).")
WHY_TRITON_RSS = "largest processes at the end of the memory run: {processes}"
WHY_GATEWAY_CPU = ("{single:.1f} ms per identify at concurrency 1; a gRPC face_pipeline call costs its "
                   "client {grpc_client:.1f} ms of CPU (the floor of the gateway's own call), the rest is "
                   "HTTP, multipart, the gallery search and JSON.")
WHY_MEMORY = "grew from {start:.0f} to {max:.0f} MiB at most (trend {slope:+.1f} MiB/min)"
WHY_MEMORY_LARGEST = "; largest at the end: {processes}"
PROCESS_MIB = "{name} {mib:.0f} MiB"

# --- the naive baselines ------------------------------------------------------------------------------
BASELINES = """\
All are `bench/naive_app.py` (one FastAPI process: decode -> detect -> align -> embed per request, \
batch 1, 1 intra-op thread per network), measured at the same concurrencies and alternating with the stack.

- **{served}** runs exactly what `face_pipeline` serves, work reductions, runtime and precisions included: \
the same work as the stack, so REST identify / naive served measures the serving overhead. The >= 0.9x \
target uses it.
- **{served_ort}** runs the same files and settings on ONNX Runtime f32: against {served}, the runtime \
alone; against {plain}, the work reductions alone.
- **{plain}** runs the same two networks the obvious way: ONNX Runtime f32, the original float NCHW \
detector file fed through `to_tensor`, every image letterboxed to the fixed 640x640 detector input \
(`dynamic_input=False`, full-size decode by OpenCV's `imdecode`) and SFace converted from the pinned \
int8 file without the PReLU rewrite (`bench/plain.py`).{check} The >= 1.6x / 2.0x targets use it: beat \
the plain approach by doing less work on a faster runtime, with unchanged decisions.

The work reduction has several sources, visible in the ceiling tables (the *onnxruntime* rows against the \
*PReLU embedder* rows, and the embedder sweeps) beside the runtime's own (the served rows against the \
*onnxruntime* rows):

- **detector input sized to the image**, large JPEGs decoded at a reduced size: fewer pixels per \
image{detector}.
- **the PReLU rewrite** (`Relu(x) - a * Relu(-x)`, exact; ONNX Runtime runs SFace's per-channel PRelu as \
a slow broadcast with layout reorders around it): fewer embedder ms per face{embedder}.
- **JPEG decode through TurboJPEG** (`facecore/jpeg.py`: libjpeg-turbo, as inside OpenCV, the same \
pixels, without `imdecode`'s overhead around it) instead of OpenCV's `imdecode`."""
PLAIN_CHECK = " {check}."
MEASURED_DETAIL = "; {text}"
DETECTOR_PIXELS = "{label} {w}x{h} instead of {pw}x{ph}: {fewer:.0%} fewer pixels"
DETECTOR_MS = ", detector {served:.1f} instead of {plain:.1f} ms per image"
DETECTOR_THREADS = " (batch 1, {threads} thread(s))"
EMBEDDER_MS = ("{served:.1f} instead of {plain:.1f} ms per face, {less:.0%} less (batch 1, {threads} "
               "thread(s))")
REDUCTIONS_ALONE = ("- the work reductions alone, in the naive app on ONNX Runtime: {speedup:.2f}x at "
                    "concurrency {c} ({served:.1f} instead of {plain:.1f} images/s, {photo}).")
RUNTIME_ALONE = ("- the served runtime alone, in the naive app: {speedup:.2f}x at concurrency {c} "
                 "({served:.1f} instead of {ort:.1f} images/s on ONNX Runtime, {photo}).")
TOGETHER = ("- together, in the naive app: {speedup:.2f}x at concurrency {c} ({served:.1f} instead of "
            "{plain:.1f} images/s, {photo}).")

# --- the document -------------------------------------------------------------------------------------
TITLE = "## Serving: ceiling, naive baseline, our stack, memory (`python -m bench`)"
HEADER = ("Command: `{command}`  \nDate: {date}  \nMachine: {machine}  \nRun: {settings}  \n"
          "Served (model_repository): {served}  \nWall time per part: {seconds}")
SETTING = "{name} {value}"
PART_MINUTES = "{name} {minutes:.1f} min"
FAILED_PARTS = "**Parts that failed in this run:**\n\n{parts}"
FAILED_PART = "- {part}: `{error}`"
TARGETS = "### Targets (reported, not asserted)"
BASELINES_HEADING = "### The naive baselines"
RATIOS = "### Ratios (both sides measured in this run)"
PLOTS_ERROR = "*{error}*"
PICTURE = "![{name}]({file})"
NAIVE_HEADING = "### Naive baselines (`bench/naive_app.py`, `bench/naive.py`)"
STACK_HEADING = "### Our stack (`bench/stack.py`)"
STACK_CPU = ("CPU milliseconds per request, by process (the Triton tree: the server and one Python-backend "
             "stub process per model instance):")
STACK_STATS = "Triton statistics per model (deltas over each run):"
HOLD = ("REST identify at the best concurrency of the sweep above and at the highest, alternating, each "
        "window back to back with its pair (`stack.hold_check`): the sweep measures each concurrency once, "
        "minutes apart, and its best is the largest of several noisy windows, so the machine's drift and "
        "that pick weigh on the sweep's ratio as much as the queues do. The target of throughput holding at "
        "the highest concurrency uses the median of these rounds.")
LATENCY_HEADING = "### Latency at concurrency 1, paired (`bench/latency.py`)"
LATENCY = ("Each round times the in-process ceiling's single image (decode + `run_pipeline`, the "
           "served runtime and files in this process, on the thread count of the ceiling's best single "
           "image), one gRPC face_pipeline call and one REST identify call, in turn, {pause:.0f} ms apart, "
           "after {warmup} rounds of warm-up: the machine's drift falls on all three alike, where the "
           "ceiling's own single image and the stack's p50 at concurrency 1 above were measured minutes "
           "apart. The p50 latency targets use these figures; each ratio here is the call's median over the "
           "ceiling's median in the same rounds.")
MEMORY_HEADING = "### Memory: REST identify at concurrency {c} for {minutes:g} min"
MEMORY = ("Resident memory sampled every {interval:.1f} s after a {warmup:.0f} s warm-up at the same load "
          "({samples} samples; {requests} requests, {throughput:.1f} images/s, {errors} errors). Every "
          "memory figure is PSS (proportional set size): a page that n processes share counts 1/n in each, "
          "so the Triton figure, the sum over the server and its Python-backend stub processes, counts the "
          "pages they share (the shared-memory regions tensors cross, the libraries) once.")
MEMORY_SHAPES = ("The requests sent the photo resized to {shapes} aspect ratios in turn (every "
                 "detector input with its longer side at 640, the shorter 64 to 640 in steps of 32, both "
                 "orientations): what the runtime keeps per input shape is in the figures, as it would be "
                 "with users' photos.")
MEMORY_SUMMED_RSS = ("Summed RSS at the end, which counts those shared pages once per process: {figures}.")
MEMORY_BREAKDOWN = "Triton's processes at the end: {processes}"
GALLERY_HEADING = "### Gallery search scaling (`bench/gallery.py`; details in [gallery.md](gallery.md))"
ENROLL_HEADING = "### Enrollment throughput (`bench/enroll.py`; details in [gallery.md](gallery.md))"
HOW_TO_READ = """\
**How to read this.** All numbers come from one run of the command above on the machine described. The
ceiling runs alone; naive, REST identify and gRPC face_pipeline alternate at every concurrency (the
servers not under load sit idle), so a slow drift of the machine hits them alike. *Ceiling*: the two
networks and the pre/post-processing in-process, best batch sizes and thread layout: what a perfect
server could do.
*Naive*: one FastAPI process doing decode -> detect -> align -> embed per request in its thread pool,
with what face_pipeline serves (*naive served*; *on ONNX Runtime*: the same on ONNX Runtime f32) or the
plain way (*naive plain*; see the baselines above).
*REST identify* goes through the whole stack (gateway: API key, multipart, `face_pipeline` over gRPC,
FAISS search, JSON); *gRPC face_pipeline* is the call the gateway makes, sent by this process directly.
Closed loop: each of N client threads sends its next request when the previous one returns. The load
generator runs on the same cores as the servers: its CPU per request is reported, and it is part of
every figure (the naive baseline and the stack pay for it alike). Triton statistics are deltas over each
run: *avg batch* is items per execution; *queue* and *request* times are per request; *compute per
execution* comes from the batch statistics (per-request compute counts a batch's time once per member).
*Outside the networks* is face_pipeline's execution time minus the detector and embedder request
times its BLS calls waited for, per image."""
