"""The parts of a checkpoint's JSON text files that generation needs, validated.

``tokenizer_config.json`` gives the special tokens and the chat template;
``generation_config.json`` and ``config.json`` give the stop ids. Keys are
Hugging Face's own; a missing file reads as empty, a malformed one is refused
by name.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator

from turbospark.errors import InstallError


def _token_text(value: Any) -> str | None:
    """``tokenizer_config.json`` writes special tokens as a string or an AddedToken dict."""
    if isinstance(value, Mapping):
        return value.get("content")
    return value


class TokenizerConfig(BaseModel):
    """The parts of ``tokenizer_config.json`` generation needs (HF's own keys)."""

    model_config = ConfigDict(extra="ignore")

    bos_token: str | None = None
    eos_token: str | None = None
    chat_template: str | None = None

    @field_validator("bos_token", "eos_token", mode="before")
    @classmethod
    def _content(cls, value: Any) -> str | None:
        return _token_text(value)

    @field_validator("chat_template", mode="before")
    @classmethod
    def _default_template(cls, value: Any) -> str | None:
        # Newer checkpoints ship a list of named templates; "default" is the chat one.
        if isinstance(value, list):
            named = {item["name"]: item["template"] for item in value}
            return named.get("default") or next(iter(named.values()), None)
        return value


class StopIds(BaseModel):
    """``eos_token_id`` as ``generation_config.json`` / ``config.json`` write it."""

    model_config = ConfigDict(extra="ignore")

    eos_token_id: int | list[int] | None = None
    text_config: dict[str, Any] | None = None

    def ids(self) -> set[int]:
        value = self.eos_token_id
        if value is None and self.text_config is not None:
            value = self.text_config.get("eos_token_id")
        if value is None:
            return set()
        return {value} if isinstance(value, int) else set(value)


_M = TypeVar("_M", bound=BaseModel)


def _read_json(file: Path) -> dict[str, Any]:
    try:
        data = json.loads(file.read_text())
    except json.JSONDecodeError as exc:
        raise InstallError(f"{file} is not valid JSON (line {exc.lineno}: {exc.msg})") from exc
    if not isinstance(data, dict):
        raise InstallError(f"{file} must hold a JSON object")
    return data


def read_validated(model: type[_M], file: Path) -> _M:
    """*file* validated as *model*; an absent file gives the model's defaults."""
    if not file.is_file():
        return model()
    try:
        return model.model_validate(_read_json(file))
    except ValidationError as exc:
        raise InstallError(f"{file} is malformed: {exc.errors()[0]['msg']}") from exc
