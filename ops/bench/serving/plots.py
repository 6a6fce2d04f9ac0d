"""PNG plots of serving runs (matplotlib, no display): output tok/s, TTFT and TPOT percentiles
against the level (concurrency or request rate), one colour per run."""

from __future__ import annotations

from pathlib import Path

from ops.bench.serving.report import level_key

PERCENTILE_STYLES = (("median", "-", "p50"), ("p95", "--", "p95"), ("p99", ":", "p99"))


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_runs(runs: dict[str, list[dict]], path: str | Path, title: str = "") -> Path:
    plt = pyplot()
    fig, (ax_tok, ax_ttft, ax_tpot) = plt.subplots(1, 3, figsize=(16, 4.8))
    kinds = {level_key(r)[0] for records in runs.values() for r in records}
    xlabel = "concurrency" if kinds == {"concurrency"} else "request rate (req/s)" \
        if kinds == {"request_rate"} else "level"
    for i, (name, records) in enumerate(runs.items()):
        color = f"C{i}"
        records = sorted(records, key=level_key)
        xs = [level_key(r)[1] for r in records]
        ax_tok.plot(xs, [r["metrics"]["output_throughput"] for r in records], "o-",
                    color=color, label=name)
        for ax, metric in ((ax_ttft, "ttft_ms"), (ax_tpot, "tpot_ms")):
            for key, style, short in PERCENTILE_STYLES:
                pts = [(x, r["metrics"][metric][key]) for x, r in zip(xs, records, strict=True)
                       if r["metrics"][metric][key] is not None]
                if pts:
                    ax.plot(*zip(*pts, strict=True), style, marker="o", markersize=3,
                            color=color, label=f"{name} {short}")
    for ax, ylabel in ((ax_tok, "output tok/s"), (ax_ttft, "TTFT (ms)"), (ax_tpot, "TPOT (ms)")):
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        if kinds == {"concurrency"}:
            ax.set_xscale("log", base=2)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    for ax in (ax_tok, ax_ttft, ax_tpot):
        lo, hi = ax.dataLim.intervaly
        if ax is not ax_tok and lo > 0 and hi / lo > 20:  # latencies spanning decades
            ax.set_yscale("log")
        else:
            ax.set_ylim(bottom=0)
    if title:
        fig.suptitle(title, fontsize=10)
    return save(fig, path)


def save(fig, path: str | Path) -> Path:
    """Lay out, write as PNG (folders made), close; the path written."""
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    pyplot().close(fig)
    return out
