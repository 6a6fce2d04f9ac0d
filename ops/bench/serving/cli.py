"""`tessera bench serve`: run the serving benchmark against one or more endpoints (interleaved
at every level, so a noisy machine hits them alike), write JSON and a PNG beside it; or, with
`--compare A.json [B.json ...]`, print the runs side by side and plot them."""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ops.bench.serving.metrics import SLO_NAMES, parse_slos, summarize
from ops.bench.serving.prompts import BenchPrompt, PromptMaker

# NOTE: the load generator and its backends (asyncio, HTTP) are imported when a benchmark
# runs: every `tessera` command builds this parser, `tessera serve` before its model starts.
if TYPE_CHECKING:
    from ops.bench.serving.backends import Backend
    from ops.bench.serving.load import Level


def add_bench_parser(subparsers: Any) -> argparse.ArgumentParser:
    bench = subparsers.add_parser("bench", help="benchmarks (tessera bench serve --help)")
    sub = bench.add_subparsers(dest="bench_command", required=True)
    p = sub.add_parser(
        "serve", help="online serving benchmark: throughput, TTFT, TPOT, ITL, goodput",
        description=__doc__, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--backend", choices=("grpc", "openai"), default="grpc",
                   help="tessera's gRPC gateway, or an OpenAI-compatible HTTP server")
    p.add_argument("--target", action="append", default=None, metavar="[LABEL=]HOST:PORT",
                   help="gRPC gateway (repeat for several; default 127.0.0.1:50051)")
    p.add_argument("--base-url", action="append", default=None, metavar="[LABEL=]URL",
                   help="OpenAI-compatible base URL ending in /v1 (repeat for several)")
    p.add_argument("--api-key", default=os.environ.get("TESSERA_API_KEY"),
                   help="bearer key (default $TESSERA_API_KEY); never written to the JSON")
    p.add_argument("--model", default=None,
                   help="model id (default: gRPC the gateway's default, HTTP the first of "
                        "/v1/models)")
    p.add_argument("--concurrency", type=int, nargs="+", default=None,
                   help="requests in flight, one level per value (default 1)")
    p.add_argument("--request-rate", type=float, nargs="+", default=None,
                   help="Poisson arrivals, requests/s, one level per value (inf: all at once); "
                        "with it, a single --concurrency caps requests in flight")
    p.add_argument("--input-len", type=int, default=64,
                   help="prompt tokens (with --prefix-len: the random suffix after the prefix)")
    p.add_argument("--output-len", type=int, default=64, help="max_tokens of every request")
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="generate exactly --output-len tokens")
    p.add_argument("--prefix-len", type=int, default=0,
                   help="tokens of a shared prefix at the start of every prompt (0: none)")
    p.add_argument("--num-prefixes", type=int, default=1,
                   help="distinct shared prefixes, used in turn")
    p.add_argument("--num-prompts", type=int, default=None,
                   help="requests per level (default: 4 x concurrency, at least 8; 64 for a "
                        "request rate)")
    p.add_argument("--max-duration-s", type=float, default=600.0,
                   help="per level and endpoint: no request is sent after this")
    p.add_argument("--request-timeout-s", type=float, default=300.0,
                   help="a request still running after this counts as a TIMEOUT error")
    p.add_argument("--warmup", type=int, default=1,
                   help="requests sent to each endpoint before the first level, not measured")
    p.add_argument("--seed", type=int, default=0,
                   help="prompts and arrival times; the same seed sends the same prompts, so "
                        "a second run against a server with a prefix cache gets hits")
    p.add_argument("--slo", action="append", default=[], metavar="NAME=MS",
                   help=f"goodput counts requests meeting every SLO; NAME: {', '.join(SLO_NAMES)}")
    p.add_argument("--tokenizer", default=None,
                   help="GGUF file or Hugging Face directory whose tokenizer builds the prompts "
                        "(default: the embedded default model)")
    p.add_argument("--out", default="ops/bench/out/serve.json",
                   help="JSON results; the PNG plot is written beside it")
    p.add_argument("--compare", nargs="+", default=None, metavar="JSON",
                   help="print these results side by side and plot them (runs nothing)")
    p.add_argument("--plot", default=None,
                   help="with --compare: the PNG (default: beside the first JSON)")
    p.set_defaults(fn=cmd_bench_serve)
    return p


def parse_endpoint(value: str) -> tuple[str, str]:
    """`LABEL=ENDPOINT` or `ENDPOINT` (then the endpoint is its own label)."""
    label, sep, rest = value.partition("=")
    if sep and label and not any(c in label for c in ":/"):
        return label, rest
    return value, value


def build_backends(args: argparse.Namespace, max_in_flight: int) -> list[Backend]:
    from ops.bench.serving.backends import GrpcBackend, OpenAIBackend

    if args.backend == "grpc":
        if not args.api_key:
            raise SystemExit("--backend grpc needs --api-key (or $TESSERA_API_KEY)")
        return [GrpcBackend(label, target, args.api_key, args.model or "")
                for label, target in map(parse_endpoint, args.target or ["127.0.0.1:50051"])]
    if not args.base_url:
        raise SystemExit("--backend openai needs --base-url http://HOST:PORT/v1")
    return [OpenAIBackend(label, url, args.api_key, args.model, max(64, 2 * max_in_flight))
            for label, url in map(parse_endpoint, args.base_url)]


def build_levels(args: argparse.Namespace) -> list[Level]:
    from ops.bench.serving.load import Level

    if args.request_rate:
        if args.concurrency and len(args.concurrency) > 1:
            raise SystemExit("with --request-rate, --concurrency takes one value (the cap)")
        cap = args.concurrency[0] if args.concurrency else None
        return [Level(concurrency=cap, request_rate=r) for r in args.request_rate]
    return [Level(concurrency=c) for c in (args.concurrency or [1])]


def num_prompts(args: argparse.Namespace, level: Level) -> int:
    if args.num_prompts is not None:
        return args.num_prompts
    if level.request_rate is not None:
        return 64
    return max(8, 4 * (level.concurrency or 1))


def make_prompts(maker: PromptMaker, args: argparse.Namespace, n: int,
                 seed: int) -> list[BenchPrompt]:
    if args.prefix_len > 0:
        return maker.prefix_prompts(n, args.prefix_len, args.num_prefixes, args.input_len,
                                    args.output_len, seed)
    return maker.random_prompts(n, args.input_len, args.output_len, seed)


@functools.lru_cache(maxsize=2)
def prompt_maker(tokenizer_path: str | None) -> PromptMaker:
    """Cached: opening a GGUF file parses all its metadata (seconds)."""
    from runtime.loader import open_checkpoint

    return PromptMaker(open_checkpoint(tokenizer_path).tokenizer)


def machine_info() -> dict[str, Any]:
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": model, "cores": os.cpu_count(), "platform": platform.platform(),
            "python": platform.python_version()}


def now_utc() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def run_config(args: argparse.Namespace) -> dict[str, Any]:
    skip = {"fn", "api_key", "compare", "plot", "command", "bench_command"}
    return {k: v for k, v in vars(args).items() if k not in skip}


async def run_benchmark(args: argparse.Namespace, report: dict[str, Any], out: Path) -> None:
    from ops.bench.serving.load import run_level

    levels = build_levels(args)
    slos = parse_slos(args.slo)
    maker = prompt_maker(args.tokenizer)
    backends = build_backends(args, max((lv.concurrency or 64) for lv in levels))
    for b in backends:
        await b.open()
    try:
        warm = make_prompts(maker, args, max(1, args.warmup), seed=args.seed - 1)
        for b in backends:
            for prompt in warm[:args.warmup]:
                r = await b.send(prompt, args.ignore_eos)
                if r.error:
                    print(f"{b.label}: warm-up request failed: {r.error}", flush=True)
        for i, level in enumerate(levels):
            # NOTE: fresh prompts per level (no cache hits from an earlier level), the same
            # for every endpoint; endpoints take turns going first.
            seed = args.seed + 1000 * (i + 1)
            prompts = make_prompts(maker, args, num_prompts(args, level), seed)
            for b in (backends if i % 2 == 0 else backends[::-1]):
                record = {"endpoint": b.describe(), "level": {
                    "kind": level.kind, "value": level.value, "concurrency": level.concurrency,
                    "request_rate": level.request_rate}, "started_at": now_utc(),
                    "load_average_before": os.getloadavg()[0], "num_prompts": len(prompts)}
                run = await run_level(b, prompts, level, ignore_eos=args.ignore_eos,
                                      max_duration_s=args.max_duration_s,
                                      request_timeout_s=args.request_timeout_s, seed=seed)
                m = summarize(run.results, run.duration_s, slos)
                record.update(load_average_after=os.getloadavg()[0], not_sent=run.not_sent,
                              metrics=m)
                report["records"].append(record)
                out.write_text(json.dumps(report, indent=2))
                print(f"{b.label} {level.kind}={level.value:g}: {m['completed']} done, "
                      f"{m['failed']} failed, {m['output_throughput']:.1f} output tok/s, "
                      f"TTFT p50 {m['ttft_ms']['median'] or 0:.0f} ms, TPOT p50 "
                      f"{m['tpot_ms']['median'] or 0:.1f} ms", flush=True)
    finally:
        for b in backends:
            await b.close()


def cmd_bench_serve(args: argparse.Namespace) -> int:
    import asyncio

    from ops.bench.serving.plots import plot_runs
    from ops.bench.serving.report import load_runs, markdown_table

    if args.compare:
        runs = load_runs(args.compare)
        print(markdown_table(runs))
        first = Path(args.compare[0])
        png = Path(args.plot) if args.plot else first.with_name(
            "_vs_".join(Path(p).stem for p in args.compare) + ".png")
        print(f"plot: {plot_runs(runs, png, ' vs '.join(runs))}")
        return 0
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"tool": "tessera bench serve", "started_at": now_utc(),
                              "machine": machine_info(), "config": run_config(args),
                              "records": []}
    asyncio.run(run_benchmark(args, report, out))
    report["finished_at"] = now_utc()
    out.write_text(json.dumps(report, indent=2))
    runs = load_runs([out])
    print(markdown_table(runs))
    print(f"results: {out}\nplot: {plot_runs(runs, out.with_suffix('.png'), out.stem)}")
    return 0
