from __future__ import annotations

from ops.eval.cli import main

raise SystemExit(main())
