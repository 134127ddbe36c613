"""The serving report's plots (matplotlib, optional: the ``bench`` extra): throughput and latency against
concurrency, and resident memory over the memory run."""

from __future__ import annotations

from pathlib import Path

from bench.results import ONE_FACE, SIX_FACES, Results, served_ceiling

PLOTS = {"throughput": "throughput.png", "latency": "latency.png", "memory": "memory.png"}


def plots(results: Results, out: Path) -> dict[str, str]:
    """PNG plots into ``out``; returns {plot: file name} or {"error": why} when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        return {"error": f"plots skipped: {exc} (install the `bench` extra: matplotlib)"}
    out.mkdir(parents=True, exist_ok=True)
    written: dict[str, str] = {}
    series = _series(results)

    if series:
        photos = [p for p in (ONE_FACE, SIX_FACES) if any(key[1] == p for key in series)]
        fig, axes = plt.subplots(1, len(photos), figsize=(6.5 * len(photos), 4.5), squeeze=False)
        for ax, photo in zip(axes[0], photos, strict=True):
            for (target, p), rows in series.items():
                if p == photo:
                    ax.plot([r[0] for r in rows], [r[1] for r in rows], marker="o", label=target)
            ceiling = served_ceiling(results, photo)
            if ceiling and ceiling.layouts:
                ax.axhline(ceiling.images_per_s, color="black", linestyle="--",
                           label=f"in-process ceiling ({ceiling.images_per_s:.1f})")
            ax.set(xscale="log", xlabel="concurrency (requests in flight)", ylabel="images/s", title=photo)
            ax.set_xticks([1, 2, 4, 8, 16], labels=["1", "2", "4", "8", "16"])
            ax.set_ylim(bottom=0)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
        fig.suptitle("Throughput vs concurrency (same machine, same run)")
        fig.tight_layout()
        fig.savefig(out / PLOTS["throughput"], dpi=110)
        plt.close(fig)
        written["throughput"] = PLOTS["throughput"]

    latency_rows = [r for r in [*results.stack, *results.naive, *results.naive_plain] if r.photo == ONE_FACE]
    if latency_rows:
        names = list(dict.fromkeys(r.target for r in latency_rows))
        fig, axes = plt.subplots(1, len(names), figsize=(4.5 * len(names), 4.2), squeeze=False, sharey=True)
        ceiling = served_ceiling(results, ONE_FACE)
        for ax, target in zip(axes[0], names, strict=True):
            runs = sorted((r for r in latency_rows if r.target == target), key=lambda r: r.concurrency)
            for attribute, label in (("p50_ms", "p50"), ("p90_ms", "p90"), ("p99_ms", "p99")):
                ax.plot([r.concurrency for r in runs], [getattr(r, attribute) for r in runs], marker="o",
                        label=label)
            if ceiling and ceiling.splits:
                ax.axhline(ceiling.single_image_ms, color="black", linestyle="--",
                           label="ceiling, single image")
            ax.set(xscale="log", xlabel="concurrency", title=target)
            ax.set_xticks([1, 2, 4, 8, 16], labels=["1", "2", "4", "8", "16"])
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
        axes[0][0].set_ylabel("latency ms")
        fig.suptitle(f"Latency percentiles vs concurrency ({ONE_FACE})")
        fig.tight_layout()
        fig.savefig(out / PLOTS["latency"], dpi=110)
        plt.close(fig)
        written["latency"] = PLOTS["latency"]

    memory = results.memory
    if memory and memory.times_s:
        fig, axes = plt.subplots(len(memory.rss_mib), 1, figsize=(8, 2.6 * len(memory.rss_mib)), sharex=True,
                                 squeeze=False)
        for ax, (process, values) in zip(axes[:, 0], memory.rss_mib.items(), strict=True):
            ax.plot([t / 60 for t in memory.times_s], values, marker=".", linewidth=1)
            start = values[0] if values else 0
            ax.axhspan(start * 0.9, start * 1.1, color="green", alpha=0.08, label="start +-10 %")
            ax.set(ylabel="PSS MiB", title="Triton (server + stubs)" if process == "triton" else process)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8, loc="lower right")
        axes[-1][0].set_xlabel("minutes")
        fig.suptitle(f"Resident memory (PSS), REST identify at concurrency {memory.concurrency}")
        fig.tight_layout()
        fig.savefig(out / PLOTS["memory"], dpi=110)
        plt.close(fig)
        written["memory"] = PLOTS["memory"]
    return written


def _series(results: Results) -> dict[tuple[str, str], list[tuple[int, float]]]:
    series: dict[tuple[str, str], list[tuple[int, float]]] = {}
    for row in [*results.stack, *results.naive, *results.naive_plain]:
        series.setdefault((row.target, row.photo), []).append((row.concurrency, row.throughput))
    return {key: sorted(values) for key, values in series.items()}
