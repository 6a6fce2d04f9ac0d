"""`tessera plan CONFIG.json ...`: what fits on which accelerators. Imports no torch."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from ops.planner.architectures import parse_config
from ops.planner.model import QUANTIZABLE
from ops.planner.plan import DEFAULT_RESERVE_FRACTION, GIB, Plan, PlanConfig, make_plan
from ops.planner.report import side_by_side, table
from runtime.errors import InvalidArgument, TesseraError
from runtime.formats import INT4_GROUP_SIZES, KV_FORMATS, WEIGHT_FORMATS, canonical_name


def _add_plan_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device-memory-gb", type=float, help="memory of one device, GiB")
    p.add_argument("--tp", type=int, help="tensor-parallel degree (default 1)")
    p.add_argument("--attention", choices=["tp", "dp"],
                   help="tp: heads split across ranks, MLA latent replicated on each (default); "
                        "dp: data-parallel attention, one rank per sequence")
    p.add_argument("--weights", type=canonical_name, choices=WEIGHT_FORMATS,
                   help="format of linear-layer weights (default bf16)")
    p.add_argument("--dtype", type=canonical_name, choices=["fp32", "bf16", "fp16"],
                   help="dtype of unquantized tensors: embeddings, norms, router (default bf16)")
    p.add_argument("--int4-targets", help="comma-separated categories int4 applies to "
                   f"(default routed_experts; any of {', '.join(QUANTIZABLE)})")
    p.add_argument("--int4-group-size", type=int, choices=INT4_GROUP_SIZES,
                   help="inputs per int4 scale (default 32)")
    p.add_argument("--int4-scheme", choices=["sym", "asym"],
                   help="asym adds a 4-bit zero point per group (default sym)")
    p.add_argument("--int4-rest", type=canonical_name, choices=["fp32", "bf16", "fp16", "fp8"],
                   help="format of linear weights outside --int4-targets (default bf16)")
    p.add_argument("--kv-cache-dtype", type=canonical_name, choices=KV_FORMATS,
                   help="KV cache format (default bf16)")
    p.add_argument("--reserve-fraction", type=float,
                   help=f"share of device memory kept for activations, CUDA graphs and runtime "
                        f"buffers (default {DEFAULT_RESERVE_FRACTION}, as vLLM's "
                        f"gpu_memory_utilization=0.9)")
    p.add_argument("--reserve-gb", type=float, help="that reserve in GiB instead of a fraction")
    p.add_argument("--kv-cache-gb", type=float,
                   help="a fixed KV pool per device in GiB (ignores device memory and reserve)")
    p.add_argument("--page-size", type=int, help="tokens per KV page (default 16)")
    p.add_argument("--mla-rope", choices=["bf16", "shared"],
                   help="MLA latents in fp8/int8 KV: the RoPE part bf16 in the row (default, "
                        "tessera's pages) or quantized under the row's one scale")
    p.add_argument("--mtp-layers", type=int,
                   help="MTP layers to count (default: num_nextn_predict_layers of the config)")


DEFAULTS: dict[str, Any] = {
    "device_memory_gb": None, "tp": 1, "attention": "tp", "weights": "bf16", "dtype": "bf16",
    "int4_targets": "routed_experts", "int4_group_size": 32, "int4_scheme": "sym",
    "int4_rest": "bf16", "kv_cache_dtype": "bf16", "reserve_fraction": DEFAULT_RESERVE_FRACTION,
    "reserve_gb": None, "kv_cache_gb": None, "page_size": 16, "mtp_layers": None,
    "mla_rope": "bf16",
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tessera plan", description=__doc__,
        epilog="example: tessera plan glm5.json --device-memory-gb 141 --tp 8 --weights int4 "
               "--kv-cache-dtype fp8 --compare kv-cache-dtype=bf16")
    p.add_argument("config", help="a Hugging Face config.json")
    _add_plan_options(p)
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--compare", nargs="+", metavar="OPTION=VALUE",
                   help="a second plan with these options changed, printed side by side "
                        "(e.g. kv-cache-dtype=fp8 weights=int4)")
    p.set_defaults(**DEFAULTS)
    return p


def overrides(pairs: list[str]) -> dict[str, Any]:
    """['kv-cache-dtype=fp8', ...] -> {'kv_cache_dtype': 'fp8', ...}, typed as the flags are."""
    p = argparse.ArgumentParser(prog="tessera plan --compare", argument_default=argparse.SUPPRESS)
    _add_plan_options(p)
    argv: list[str] = []
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise InvalidArgument(f"--compare takes OPTION=VALUE pairs, got {pair!r}",
                                  field="compare")
        argv += [f"--{key.strip().removeprefix('--')}", value]
    return vars(p.parse_args(argv))


def plan_config(opts: dict[str, Any]) -> PlanConfig:
    def gib(name: str) -> int | None:
        value = opts[name]
        return None if value is None else int(value * GIB)

    targets = tuple(t.strip() for t in opts["int4_targets"].split(",") if t.strip())
    return PlanConfig(
        weights=opts["weights"], dtype=opts["dtype"], int4_targets=targets,
        int4_rest=opts["int4_rest"], int4_group_size=opts["int4_group_size"],
        int4_symmetric=opts["int4_scheme"] == "sym", kv_cache_dtype=opts["kv_cache_dtype"],
        tp=opts["tp"], attention=opts["attention"], device_memory_bytes=gib("device_memory_gb"),
        reserve_fraction=opts["reserve_fraction"], reserve_bytes=gib("reserve_gb"),
        kv_cache_bytes=gib("kv_cache_gb"), page_size=opts["page_size"],
        mla_rope=opts["mla_rope"])


def read_config(path: str) -> dict[str, Any]:
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise InvalidArgument(f"cannot read config {path!r}: {e.strerror}", field="config") from e
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise InvalidArgument(f"{path} is not valid JSON: {e}", field="config") from e


def plan_from_options(cfg: dict[str, Any], opts: dict[str, Any]) -> Plan:
    spec = parse_config(cfg, mtp_layers=opts["mtp_layers"])
    return make_plan(spec, plan_config(opts))


def run(argv: list[str]) -> str:
    args = build_parser().parse_args(argv)
    opts = vars(args)
    cfg = read_config(args.config)
    a = plan_from_options(cfg, opts)
    if not args.compare:
        return json.dumps(a.to_json(), indent=2) if args.json else table(a, Path(args.config).stem)
    changed = overrides(args.compare)
    b = plan_from_options(cfg, {**opts, **changed})
    if args.json:
        return json.dumps({"a": a.to_json(), "b": b.to_json()}, indent=2)
    label = " ".join(f"{k.replace('_', '-')}={v}" for k, v in changed.items())
    return side_by_side(a, b, ("A (as given)", f"B ({label})"))


def main(argv: list[str] | None = None) -> int:
    try:
        print(run(sys.argv[1:] if argv is None else argv))
    except TesseraError as e:
        field = e.metadata.get("field")
        print(f"error: {e.reason}: {e.message}" + (f" [field: {field}]" if field else ""),
              file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
