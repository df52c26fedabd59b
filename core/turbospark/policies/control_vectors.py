"""llama.cpp's control-vector files, and making a vector from contrastive prompts.

The format (llama.cpp ``common.cpp``, ``llama_control_vector_load_one``): a GGUF
whose ``general.architecture`` is ``controlvector``, with one F32 1-D tensor
``direction.{k}`` per layer, ``k`` from 1. We read and write it through ggml's
own ``gguf`` package, so a vector made here loads in llama.cpp and back.

Making one follows repeng: run each positive and negative prompt, keep the
last token's hidden state at every layer's output, then per layer either the
difference of the means (``mean``) or the first principal component of the
paired differences, signed so the positives project higher (``pca``).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

import numpy as np

from turbospark.errors import InvalidInput

ARCH = "controlvector"
Method = Literal["mean", "pca"]
_DIRECTION = re.compile(r"direction\.(\d+)")


def read_control_vector(path: Path) -> dict[int, np.ndarray]:
    """``{layer: float32 (hidden,)}`` from a control-vector GGUF; refused by name
    when the file is missing, not a GGUF, or not a control vector."""
    import gguf

    if not path.is_file():
        raise InvalidInput(f"control vector {path} does not exist; pass a .gguf control vector")
    try:
        reader = gguf.GGUFReader(path)
    except (ValueError, OSError) as exc:
        raise InvalidInput(
            f"{path} is not a GGUF file ({exc}); pass a llama.cpp control vector"
        ) from None
    field = reader.get_field("general.architecture")
    arch = None if field is None else field.contents()
    if arch != ARCH:
        raise InvalidInput(
            f"{path} is a GGUF of architecture {arch!r}, not a control vector ({ARCH!r}); "
            "pass a control vector (llama.cpp's cvector-generator, repeng or `turbospark steer "
            "extract` make them)"
        )
    out: dict[int, np.ndarray] = {}
    for tensor in reader.tensors:
        match = _DIRECTION.fullmatch(tensor.name)
        if match is None:
            continue  # llama.cpp ignores other tensors too
        layer = int(match.group(1))
        if tensor.tensor_type != gguf.GGMLQuantizationType.F32 or len(tensor.shape) != 1:
            raise InvalidInput(
                f"{path}: {tensor.name} must be a 1-D F32 tensor, found "
                f"{tensor.tensor_type.name} of shape {list(tensor.shape)}; rebuild the vector"
            )
        if layer == 0:
            raise InvalidInput(
                f"{path}: direction.0 is invalid (layers are numbered from 1, as in llama.cpp)"
            )
        # Several directions for one layer in one file add up (llama.cpp does the same).
        vector = np.array(tensor.data, dtype=np.float32).reshape(-1)
        out[layer] = out.get(layer, 0) + vector
    if not out:
        raise InvalidInput(f"{path} has no direction.N tensor; it is not a usable control vector")
    return out


def write_control_vector(
    path: Path, directions: dict[int, np.ndarray], model_hint: str | None = None
) -> None:
    """Write *directions* in llama.cpp's format (what repeng's ``export_gguf`` writes)."""
    import gguf

    writer = gguf.GGUFWriter(path, ARCH)
    if model_hint:
        writer.add_string(f"{ARCH}.model_hint", model_hint)
    writer.add_uint32(f"{ARCH}.layer_count", len(directions))
    for layer, vector in sorted(directions.items()):
        writer.add_tensor(f"direction.{layer}", np.asarray(vector, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def directions_from_states(
    positive: Sequence[dict[int, np.ndarray]],
    negative: Sequence[dict[int, np.ndarray]],
    method: Method,
) -> dict[int, np.ndarray]:
    """Per layer, a direction from paired last-token states (each a
    ``{layer: (hidden,)}``): ``mean`` = mean(positive) - mean(negative);
    ``pca`` = the first principal component of the centred differences
    (unit length), signed so positive prompts project higher on average."""
    if len(positive) != len(negative) or not positive:
        raise InvalidInput(
            f"{len(positive)} positive and {len(negative)} negative prompts: pass the same, "
            "non-zero number of each (they are paired line by line)"
        )
    if method == "pca" and len(positive) < 2:
        raise InvalidInput("--method pca needs at least 2 prompt pairs; add pairs or use mean")
    out = {}
    for layer in positive[0]:
        pos = np.stack([p[layer] for p in positive]).astype(np.float64)  # (pairs, hidden)
        neg = np.stack([n[layer] for n in negative]).astype(np.float64)
        if method == "mean":
            out[layer] = (pos.mean(axis=0) - neg.mean(axis=0)).astype(np.float32)
            continue
        diffs = pos - neg
        centred = diffs - diffs.mean(axis=0)
        _, _, vt = np.linalg.svd(centred, full_matrices=False)
        direction = vt[0]
        if (pos @ direction).mean() < (neg @ direction).mean():
            direction = -direction
        out[layer] = direction.astype(np.float32)
    return out


def read_prompts(path: Path) -> list[str]:
    """One prompt per non-empty line."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise InvalidInput(f"cannot read prompts from {path}: {exc.strerror}") from None
    prompts = [line for line in lines if line.strip()]
    if not prompts:
        raise InvalidInput(f"{path} holds no prompt; write one prompt per line")
    return prompts
