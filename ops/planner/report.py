"""Plans for people: one table per plan, or two plans side by side (`--compare`)."""

from __future__ import annotations

from ops.planner.plan import GIB, Plan


def _gib(n: int | None) -> str:
    return "-" if n is None else f"{n / GIB:,.2f}"


def _count(n: int | None) -> str:
    return "-" if n is None else f"{n:,}"


def _billions(n: int) -> str:
    return f"{n / 1e9:,.2f} B" if n >= 1e8 else f"{n / 1e6:,.2f} M"


def weights_label(plan: Plan) -> str:
    c = plan.config
    if c.weights != "int4":
        return c.weights
    scheme = "" if c.int4_symmetric else "-asym"
    return f"int4-g{c.int4_group_size}{scheme} ({'+'.join(c.int4_targets)}), {c.int4_rest} rest"


def deployment_line(plan: Plan) -> str:
    c = plan.config
    where = (f"{_gib(c.device_memory_bytes)} GiB devices" if c.device_memory_bytes is not None
             else "no device size given")
    if c.kv_cache_bytes is not None:
        where = f"a fixed {_gib(c.kv_cache_bytes)} GiB KV pool per device"
    return (f"weights {weights_label(plan)}; KV {c.kv_cache_dtype}; TP {c.tp} "
            f"(attention {c.attention}); {where}")


def capacity_line(plan: Plan) -> str:
    c = plan.config
    if plan.kv_capacity_tokens is None:
        return "KV capacity: give --device-memory-gb (or --kv-cache-gb) to size the pool"
    tokens = f"{plan.kv_capacity_tokens:,} tokens of KV"
    if c.kv_cache_bytes is not None:
        return f"KV pool {_gib(c.kv_cache_bytes)} GiB per device -> {tokens}"
    line = (f"device {_gib(c.device_memory_bytes)} - weights {_gib(plan.weight_bytes_per_device)}"
            f" - reserve {_gib(plan.reserve_bytes)} = KV budget "
            f"{_gib(plan.kv_budget_bytes_per_device)} GiB per device -> {tokens}")
    if not plan.fits:
        line += "  ** DOES NOT FIT **"
    return line


def table(plan: Plan, title: str = "") -> str:
    head = f"{title}: " if title else ""
    lines = [f"{head}{plan.architecture} ({plan.family}), {_billions(plan.parameters)} "
             "parameters", deployment_line(plan), "",
             f"{'category':<16}{'params':>12}  {'format':<22}{'total GiB':>12}"
             f"{'scales+zeros GiB':>18}{'per device GiB':>16}"]
    for c in plan.breakdown:
        lines.append(f"{c.category:<16}{_billions(c.parameters):>12}  "
                     f"{'/'.join(c.formats):<22}{_gib(c.total_bytes):>12}"
                     f"{_gib(c.scale_bytes + c.zero_bytes):>18}{_gib(c.per_device_bytes):>16}")
    overhead = sum(c.scale_bytes + c.zero_bytes for c in plan.breakdown)
    lines.append(f"{'total':<16}{_billions(plan.parameters):>12}  {'':<22}"
                 f"{_gib(plan.weight_bytes_total):>12}{_gib(overhead):>18}"
                 f"{_gib(plan.weight_bytes_per_device):>16}")
    lines += ["", f"KV per token: {plan.kv_bytes_per_token:,} B per device "
              f"({plan.kv_bytes_per_token_model:,} B for one unsharded copy)",
              capacity_line(plan), "", "assumptions:"]
    lines += [f"  - {a}" for a in plan.assumptions]
    return "\n".join(lines)


def side_by_side(a: Plan, b: Plan, labels: tuple[str, str] = ("A", "B")) -> str:
    rows = [
        ("weights", weights_label(a), weights_label(b)),
        ("kv cache dtype", a.config.kv_cache_dtype, b.config.kv_cache_dtype),
        ("tp / attention", f"{a.config.tp} / {a.config.attention}",
         f"{b.config.tp} / {b.config.attention}"),
        ("weights total GiB", _gib(a.weight_bytes_total), _gib(b.weight_bytes_total)),
        ("weights per device GiB", _gib(a.weight_bytes_per_device),
         _gib(b.weight_bytes_per_device)),
        ("KV bytes/token/device", _count(a.kv_bytes_per_token), _count(b.kv_bytes_per_token)),
        ("reserve per device GiB", _gib(a.reserve_bytes), _gib(b.reserve_bytes)),
        ("KV budget per device GiB", _gib(a.kv_budget_bytes_per_device),
         _gib(b.kv_budget_bytes_per_device)),
        ("KV capacity tokens", _count(a.kv_capacity_tokens), _count(b.kv_capacity_tokens)),
    ]
    per_device = {c.category: c.per_device_bytes for c in b.breakdown}
    for c in a.breakdown:
        rows.append((f"  {c.category} per device GiB", _gib(c.per_device_bytes),
                     _gib(per_device.get(c.category))))
    if a.kv_capacity_tokens and b.kv_capacity_tokens:
        rows.append(("capacity B / A", "", f"{b.kv_capacity_tokens / a.kv_capacity_tokens:.3f}x"))
    names = max(len(r[0]) for r in rows) + 2
    width = max(len(labels[0]), *(len(r[1]) for r in rows)) + 2
    lines = [f"{a.architecture} ({a.family}), {_billions(a.parameters)} parameters", "",
             f"{'':<{names}}{labels[0]:<{width}}{labels[1]}"]
    lines += [f"{name:<{names}}{x:<{width}}{y}" for name, x, y in rows]
    return "\n".join(lines)
