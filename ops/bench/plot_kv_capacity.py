"""Plot output tok/s against concurrency per KV format from `bench_kv_formats`'s JSON, marking
the points where a format ran out of pages (preempted or could not run every sequence at once),
beside the reference's shape: BF16 stops where memory runs out, FP8 goes on.

    python3 -m ops.bench.plot_kv_capacity ops/bench/out/kv_formats.json --out kv.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ops.bench.serving.plots import save

# One provider's H200 report (docs/DESIGN.md): output tok/s by concurrency; BF16 KV out of
# memory past 32; FP8 KV not reported at 32.
REFERENCE = {"bf16": {1: 137, 8: 731, 16: 1106, 32: 1558},
             "fp8": {1: 125, 8: 689, 16: 1028, 64: 2192}}
COLORS = {"bf16": "C0", "fp8": "C1"}


def out_of_pages(point: dict, concurrency: int) -> bool:
    return point["preemptions"] > 0 or point["peak_running"] < concurrency


def plot(report: dict, path: str | Path, reference: bool = True) -> Path:
    from ops.bench.serving.plots import pyplot

    plt = pyplot()
    panels = 2 if reference else 1
    fig, axes = plt.subplots(1, panels, figsize=(6.5 * panels, 4.5), squeeze=False)
    ax = axes[0][0]
    cap = report["capacity_tokens"]
    rows = sorted(report["rows"], key=lambda r: r["concurrency"])
    for fmt in ("bf16", "fp8"):
        xs = [r["concurrency"] for r in rows]
        ys = [r[fmt]["tok_s"] for r in rows]
        ax.plot(xs, ys, "o-", color=COLORS[fmt],
                label=f"{fmt.upper()} KV ({cap[fmt]:,} tokens)")
        short = [(r["concurrency"], r[fmt]["tok_s"]) for r in rows
                 if out_of_pages(r[fmt], r["concurrency"])]
        if short:
            ax.plot(*zip(*short, strict=True), "o", markersize=14, markerfacecolor="none",
                    markeredgewidth=1.5, color=COLORS[fmt],
                    label=f"{fmt.upper()} out of pages (preempts)")
    ax.set_title(f"tessera, same {report['kv_cache_bytes'] / 2**20:.0f} MiB KV budget "
                 f"({report.get('date', '')}, {report.get('threads', '?')} threads)", fontsize=9)
    if reference:
        ref = axes[0][1]
        for fmt, points in REFERENCE.items():
            ref.plot(list(points), list(points.values()), "o-", color=COLORS[fmt],
                     label=f"{fmt.upper()} KV")
        ref.plot([32], [REFERENCE["bf16"][32]], "x", color="k", markersize=9,
                 label="BF16 out of memory past 32")
        ref.set_title("reference: one provider's H200 report (docs/DESIGN.md)", fontsize=9)
    for a in axes[0]:
        a.set_xscale("log", base=2)
        a.set_xlabel("concurrency")
        a.set_ylabel("output tok/s")
        a.set_ylim(bottom=0)
        a.grid(True, alpha=0.3)
        a.legend(fontsize=8)
    return save(fig, path)


def main(argv: list[str] | None = None) -> Path:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("json", nargs="?", default="ops/bench/out/kv_formats.json",
                    help="bench_kv_formats output (its --out)")
    ap.add_argument("--out", default=None, help="PNG path (default: beside the JSON)")
    ap.add_argument("--no-reference", action="store_true",
                    help="leave out the reference panel")
    args = ap.parse_args(argv)
    src = Path(args.json)
    out = plot(json.loads(src.read_text()), args.out or src.with_suffix(".png"),
               reference=not args.no_reference)
    print(f"plot: {out}")
    return out


if __name__ == "__main__":
    main()
