"""Generates the Python stubs for proto/tessera/v1/*.proto: `python -m gateway.protos [OUT]`.

The stubs are committed under gateway/_proto so nothing needs the generator at run time;
tests/gateway/test_protos.py regenerates them into a temp dir and fails when they differ.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from runtime.extras import require_extra

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "proto"
DEFAULT_OUT = ROOT / "gateway" / "_proto"
PACKAGE = "gateway._proto"
# protoc writes imports relative to the proto root; the stubs live inside the gateway package.
_IMPORT = re.compile(r"^from tessera\.v1 import ", re.MULTILINE)


def proto_files() -> list[Path]:
    return sorted(PROTO_DIR.glob("tessera/**/*.proto"))


def generate(out_dir: Path = DEFAULT_OUT) -> list[Path]:
    """Write *_pb2.py, *_pb2.pyi and *_pb2_grpc.py (and package __init__ files) under out_dir."""
    require_extra("protos", "grpc_tools", what="python -m gateway.protos")
    import grpc_tools
    from grpc_tools import protoc

    out_dir.mkdir(parents=True, exist_ok=True)
    well_known = Path(grpc_tools.__file__).parent / "_proto"
    files = [str(p.relative_to(PROTO_DIR)) for p in proto_files()]
    args = ["protoc", f"-I{PROTO_DIR}", f"-I{well_known}", f"--python_out={out_dir}",
            f"--pyi_out={out_dir}", f"--grpc_python_out={out_dir}", *files]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")
    written = []
    for path in sorted(out_dir.rglob("*_pb2*.py*")):
        text = _IMPORT.sub(f"from {PACKAGE}.tessera.v1 import ", path.read_text())
        path.write_text(f"# ruff: noqa\n{text}")
        written.append(path)
    for pkg in {out_dir, *(p.parent for p in written), *(p.parent.parent for p in written)}:
        init = pkg / "__init__.py"
        if pkg.is_relative_to(out_dir) and not init.exists():
            init.write_text("")
    return written


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    out = Path(argv[0]) if argv else DEFAULT_OUT
    for path in generate(out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
