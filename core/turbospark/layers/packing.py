"""How one quantized tensor is packed, and recovering that from its shapes.

Below the loader because layers (stacked expert tables) and the expert cache
read packed tensors too: a packed ``weight`` (uint32, its last axis the inputs
``bits/32`` to a word) beside ``scales`` (and, in affine mode, ``biases``), one
per ``group_size`` inputs. :func:`spec_from_shapes` is mlx-lm's own rule, so
shapes that fit no setting are refused by name, wherever they are read.
"""

from __future__ import annotations

from typing import Literal

import mlx.core as mx
from pydantic import BaseModel, ConfigDict, Field

from turbospark.errors import InstallError

Mode = Literal["affine", "mxfp4", "nvfp4", "mxfp8"]
MODES: tuple[str, ...] = ("affine", "mxfp4", "nvfp4", "mxfp8")
AFFINE_BITS = (2, 3, 4, 5, 6, 8)
# The microscaling modes allow exactly one (bits, group_size) pair each.
FIXED: dict[str, tuple[int, int]] = {"mxfp4": (4, 32), "nvfp4": (4, 16), "mxfp8": (8, 32)}
_BY_SHAPE = {shape: mode for mode, shape in FIXED.items()}


class QuantSpec(BaseModel):
    """How one module's weight is packed."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    group_size: int = Field(gt=0)
    bits: int = Field(gt=0)
    mode: Mode = "affine"

    def check(self) -> QuantSpec:
        """Refuse settings MLX cannot pack, naming the ones it can."""
        if self.mode == "affine" and self.bits not in AFFINE_BITS:
            raise InstallError(
                f"{self.bits}-bit affine quantization is not supported; use one of "
                f"{', '.join(map(str, AFFINE_BITS))} bits"
            )
        if self.mode != "affine" and (self.bits, self.group_size) != FIXED[self.mode]:
            bits, group = FIXED[self.mode]
            raise InstallError(
                f"{self.mode} packs {bits} bits in groups of {group}, not "
                f"{self.bits} bits in groups of {self.group_size}; drop --bits/--group-size"
            )
        return self

    def label(self) -> str:
        """``4-bit affine, group 64``: how the CLI prints a setting."""
        return f"{self.bits}-bit {self.mode}, group {self.group_size}"

    def packed_width(self, in_dims: int) -> int:
        """uint32 words per row of *in_dims* inputs."""
        return in_dims * self.bits // 32


def spec_from_shapes(
    path: str,
    in_dims: int,
    packed: tuple[tuple[int, ...], bool],
    scales: tuple[tuple[int, ...], bool],
    has_biases: bool,
) -> QuantSpec:
    """The settings *path*'s packed weight was written with, from the shapes of
    its packed weight and scales, each given as ``(shape, is_uint)`` (uint32
    words; uint8 scales: only affine keeps its scales in a floating dtype)."""
    (packed_shape, words), (scales_shape, byte_scales) = packed, scales
    groups, width = scales_shape[-1], packed_shape[-1]
    if not words or groups == 0 or in_dims % groups or (width * 32) % in_dims:
        raise InstallError(
            f"{path} is stored quantized with weight {tuple(packed_shape)} and scales "
            f"{tuple(scales_shape)}, which fit no packing of {in_dims} inputs; "
            "re-convert the checkpoint"
        )
    group_size, bits = in_dims // groups, (width * 32) // in_dims
    if not byte_scales:
        mode = "affine"
    elif (bits, group_size) in _BY_SHAPE:
        mode = _BY_SHAPE[(bits, group_size)]
    else:
        raise InstallError(
            f"{path} has {bits}-bit weights in groups of {group_size} with uint8 scales, "
            "which is none of mxfp4, nvfp4, mxfp8; re-convert the checkpoint"
        )
    if mode == "affine" and not has_biases:
        raise InstallError(f"{path} is affine-quantized but has no biases; re-convert it")
    return QuantSpec(group_size=group_size, bits=bits, mode=mode).check()


def spec_of(
    path: str, in_dims: int, weight: mx.array, scales: mx.array, has_biases: bool
) -> QuantSpec:
    """:func:`spec_from_shapes` for arrays in memory."""
    return spec_from_shapes(
        path,
        in_dims,
        (tuple(weight.shape), weight.dtype == mx.uint32),
        (tuple(scales.shape), scales.dtype == mx.uint8),
        has_biases,
    )
