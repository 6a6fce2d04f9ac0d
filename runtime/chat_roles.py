"""The chat message roles every API accepts (OpenAI's: `developer` is its newer `system`)."""

from __future__ import annotations

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


def role_error(role: object) -> str | None:
    """Why `role` is refused (a message naming no value: roles can be long), or None."""
    if role in CHAT_ROLES:
        return None
    return f"role must be one of {', '.join(CHAT_ROLES)}"
