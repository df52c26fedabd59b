"""A checkpoint's ``config.json`` -> a family's validated arch: the one reading of it.

The importer and every later open of the install go through
:func:`arch_from_config`, so the arch the runner uses is always the one
``config.json`` says, and ``manifest.json`` (which records it) can be checked
against it. What it accepts:

- flat text configs (``gemma4_text``, ``qwen3_5_text``, mlx-lm's own flat layouts);
- nested release configs: the decoder under ``text_config``, the towers beside it;
- explicit nulls, kept as nulls (a dropped null would silently become the
  family's default, e.g. Gemma 4's softcap of 30.0 where transformers has none).

Family-specific spellings (Gemma 4's ``per_layer_config``, Qwen's
``layer_types``) are read by the family's own ``ArchConfig``. A key the family
reads that appears both at the top and in ``text_config`` with different values
is refused by name: transformers reads some top-level keys (the tie flag), mlx-lm
the inner ones, and the two would compute different models.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from turbospark.contract.hookspecs import ArchConfig
from turbospark.errors import InstallError

# Keys that legitimately differ between a release's top level and its decoder.
_NOT_DUPLICATES = frozenset({"family", "model_type"})
# Top-level keys the decoder inherits when text_config lacks them: transformers
# ties the head by the top-level flag, and generation stops on the top-level ids.
_INHERITED = ("eos_token_id", "tie_word_embeddings")


class HFConfig(BaseModel):
    """The top of a checkpoint's ``config.json``: enough to find the text config."""

    model_config = ConfigDict(extra="allow")

    model_type: str | None = None
    text_config: dict[str, Any] | None = None

    @property
    def text_model_type(self) -> str | None:
        """The decoder's ``model_type``: the nested one when there is one."""
        inner = (self.text_config or {}).get("model_type")
        return inner or self.model_type

    def text(self, fields: set[str]) -> dict[str, Any]:
        """The text decoder's config, nulls kept: ``text_config`` when nested
        (release checkpoints), else the whole file. *fields* are the keys the
        family reads; one set differently at both levels is refused by name."""
        top = self.model_dump(exclude={"text_config"})
        if self.text_config is None:
            return top
        merged = dict(self.text_config)
        for key in sorted(fields - _NOT_DUPLICATES):
            if key in top and key in merged and top[key] != merged[key]:
                raise InstallError(
                    f"config.json sets {key}={json.dumps(top[key])} but "
                    f"text_config.{key}={json.dumps(merged[key])}: conflicting duplicated "
                    "fields (transformers and mlx-lm would read different ones); make them agree"
                )
        for key in _INHERITED:
            if key not in merged and key in top:
                merged[key] = top[key]
        return merged


def read_config(path: Path) -> HFConfig:
    """Parse ``config.json`` at *path*; a malformed file is refused by name."""
    if not path.is_file():
        raise InstallError(f"{path} not found: {path.parent} is not a Hugging Face checkpoint")
    try:
        return HFConfig.model_validate(json.loads(path.read_text()))
    except (json.JSONDecodeError, ValidationError) as exc:
        raise InstallError(f"{path} is not a valid Hugging Face config: {exc}") from exc


def describe(error: ValidationError) -> str:
    """A pydantic error as ``field: message; ...`` on one line."""
    return "; ".join(
        f"{'.'.join(str(p) for p in e['loc']) or '<root>'}: {e['msg']}" for e in error.errors()
    )


def arch_from_config(config: HFConfig, arch_cls: type[ArchConfig], family: str) -> ArchConfig:
    """The arch *config* describes, validated by *family*'s ``ArchConfig``."""
    text = config.text(set(arch_cls.model_fields))
    try:
        return arch_cls.model_validate({**text, "family": family})
    except ValidationError as exc:
        raise InstallError(
            f"config.json does not fit family '{family}' (model_type "
            f"{config.text_model_type!r}): {describe(exc)}"
        ) from exc
