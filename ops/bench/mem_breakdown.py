"""Where a server's idle memory goes: start it as `ops.bench.peers` does (spawn, first one-token
answer, settle), then, for every process of its tree, RSS / PSS / USS and the resident bytes of
its mappings grouped by what they are (`/proc/PID/smaps`): the heap and anonymous memory,
torch's and other shared libraries, Python itself, mapped model files.

    python -m ops.bench.mem_breakdown --out ops/bench/out/mem.json \
        -- env TESSERA_API_KEYS=k=bench python -m ops.cli serve --grpc-port 0 --http-port {port}

`{port}` becomes a free loopback port; `--api-key` (else $TESSERA_API_KEY) authorizes the
readiness request. Linux only (reads /proc). Figures in MiB; PSS splits pages shared between
processes (the libraries the gateway and worker both map) so the tree's PSS sums honestly,
where summed RSS counts them twice.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import sys
import time
from collections import defaultdict
from pathlib import Path

import psutil

from ops.bench.peers import Peer, start, stop
from ops.bench.soak import free_port

MIB = 2**20
_HEADER = re.compile(r"^[0-9a-f]+-[0-9a-f]+ ")


def mapping_group(path: str) -> str:
    """A mapping's group from its path in /proc/PID/smaps ('' for anonymous)."""
    if not path or path.startswith("[anon") or path == "[heap]":
        return "heap + anonymous"
    if path.startswith("["):
        return "stack + kernel"
    if path.endswith((".gguf", ".safetensors", ".bin")):
        return "model file (mapped)"
    if "/torch/" in path or "/torch_" in path or "libgomp" in path or "tessera_cpu_ops" in path:
        return "torch + native ops (libraries)"
    if "/numpy" in path:
        return "numpy (libraries)"
    if "grpc" in path:
        return "grpc (libraries)"
    if "libpython" in path or path.endswith("/python3.11") or "/bin/python" in path:
        return "python interpreter"
    if "site-packages" in path or "lib-dynload" in path:
        return "other Python extensions"
    return "system libraries + other files"


def smaps_groups(pid: int) -> dict[str, dict[str, float]]:
    """Rss and Pss (MiB) per mapping group of one process."""
    out: dict[str, dict[str, float]] = defaultdict(lambda: {"rss": 0.0, "pss": 0.0})
    group = ""
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            if _HEADER.match(line):
                parts = line.split(None, 5)
                group = mapping_group(parts[5].strip() if len(parts) > 5 else "")
            elif line.startswith("Rss:"):
                out[group]["rss"] += int(line.split()[1]) / 1024
            elif line.startswith("Pss:"):
                out[group]["pss"] += int(line.split()[1]) / 1024
    return {k: {m: round(v, 1) for m, v in d.items()} for k, d in
            sorted(out.items(), key=lambda kv: -kv[1]["rss"])}


def role(proc: psutil.Process) -> str:
    cmd = " ".join(proc.cmdline())
    if "gateway.worker" in cmd:
        return "worker"
    if " serve" in cmd:
        return "gateway + REST shim"
    return proc.name()


def breakdown(root_pid: int) -> list[dict]:
    root = psutil.Process(root_pid)
    rows = []
    for p in [root, *root.children(recursive=True)]:
        full = p.memory_full_info()
        rows.append({"pid": p.pid, "role": role(p), "threads": p.num_threads(),
                     "rss_mib": round(full.rss / MIB, 1), "pss_mib": round(full.pss / MIB, 1),
                     "uss_mib": round(full.uss / MIB, 1), "groups": smaps_groups(p.pid)})
    return rows


def print_rows(rows: list[dict]) -> None:
    for r in rows:
        print(f"{r['role']} (pid {r['pid']}, {r['threads']} threads): RSS {r['rss_mib']:.0f}, "
              f"PSS {r['pss_mib']:.0f}, USS {r['uss_mib']:.0f} MiB")
        for name, g in r["groups"].items():
            if g["rss"] >= 1:
                print(f"    {name:34s} RSS {g['rss']:7.1f}  PSS {g['pss']:7.1f}")
    print(f"tree: RSS {sum(r['rss_mib'] for r in rows):.0f}, "
          f"PSS {sum(r['pss_mib'] for r in rows):.0f} MiB")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv:
        raise SystemExit("usage: mem_breakdown [--out F] -- COMMAND (with {port})")
    ours, command = argv[:argv.index("--")], argv[argv.index("--") + 1:]
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=None, help="JSON of the breakdown")
    p.add_argument("--api-key", default=os.environ.get("TESSERA_API_KEY"))
    p.add_argument("--ready-timeout-s", type=float, default=600.0)
    p.add_argument("--settle-s", type=float, default=5.0)
    args = p.parse_args(ours)
    port = free_port()
    peer = Peer("server", shlex.split(shlex.join(command).replace("{port}", str(port))), port)
    log_dir = (args.out.parent if args.out else Path("/tmp"))
    log_dir.mkdir(parents=True, exist_ok=True)
    try:
        start(peer, args.api_key, log_dir, args.ready_timeout_s)
        time.sleep(args.settle_s)
        assert peer.proc is not None
        rows = breakdown(peer.proc.pid)
    finally:
        stop(peer)
    print(f"ready (first answer) in {peer.cold_start_s:.1f} s")
    print_rows(rows)
    if args.out:
        args.out.write_text(json.dumps({"command": shlex.join(command),
                                        "cold_start_s": peer.cold_start_s,
                                        "processes": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
