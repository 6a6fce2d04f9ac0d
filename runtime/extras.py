"""Optional extras (pyproject.toml `[project.optional-dependencies]`): a command that needs one
checks for it first and, when it is missing, exits with one line naming the extra to install,
before doing any work."""

from __future__ import annotations

import importlib.util


class MissingExtra(SystemExit):
    """An optional extra is not installed. A SystemExit: the command ends with its one-line
    message on stderr and exit status 1, no traceback."""

    def __init__(self, what: str, extra: str, module: str) -> None:
        self.extra = extra
        self.module = module
        super().__init__(f"{what} needs the '{extra}' extra ({module} is not installed): "
                         f"pip install -e \".[{extra}]\"")


def require_extra(extra: str, *modules: str, what: str) -> None:
    """Raise MissingExtra unless every module in `modules` can be imported; `what` names the
    command or feature for the message."""
    for module in modules:
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):  # a broken or half-removed install counts as absent
            found = False
        if not found:
            raise MissingExtra(what, extra, module)
