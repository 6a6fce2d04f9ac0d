"""The base of every HTTP request body: unknown fields refused, no type coercion, text that
encodes as UTF-8 (shared by gateway/rest/schemas.py and gateway/rest/structured.py)."""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict


def utf8(value: str) -> str:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("must be valid UTF-8 (no lone surrogates)") from None
    return value


Text = Annotated[str, AfterValidator(utf8)]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
