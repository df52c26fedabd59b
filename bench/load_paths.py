"""Ways to read a session-sized safetensors file into MLX arrays, timed (and an
SDPA check at gemma4's head dims), to choose ``turbospark.sessions.session_file``'s loader.

A 268 MB file of 16 bf16 tensors ``(1, 2, 16384, 256)`` (a 16k-token K/V), read
from the page cache three times each way: ``mx.load``; a memory map copied into
arrays one tensor at a time (``np_seq``) or in 8 threads (``np_threads``, what
``read_session`` does); ``readinto`` of the whole file and one array from it;
and the first device use of the loaded bytes. The SDPA check compares
``mx.fast.scaled_dot_product_attention`` with a matmul-softmax reference at
head dims 128/256/512, query lengths 1/12/100, with no, causal and windowed
masks, and lists any case off by more than 1e-3.

    python bench/load_paths.py > OUT.json      # on the device being measured
"""

from __future__ import annotations

import json
import mmap
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx
import numpy as np

from turbospark.sessions import session_file as disk


def _reference_attention(q, k, v, scale, mask):
    repeat = q.shape[1] // k.shape[1]
    k, v = mx.repeat(k, repeat, axis=1), mx.repeat(v, repeat, axis=1)
    scores = (q * scale) @ k.swapaxes(-1, -2)
    if mask is not None:
        scores = mx.where(mask, scores, -1e30)
    return mx.softmax(scores.astype(mx.float32), axis=-1).astype(q.dtype) @ v


def sdpa_mismatches() -> list[dict]:
    bad, keys = [], 524
    for dim in (128, 256, 512):
        for length in (1, 12, 100):
            for kind in ("none", "causal", "window"):
                if kind == "causal" and length == 1:
                    continue
                q = mx.random.normal((1, 8, length, dim))
                k, v = mx.random.normal((1, 2, keys, dim)), mx.random.normal((1, 2, keys, dim))
                rows, cols = mx.arange(keys - length, keys)[:, None], mx.arange(keys)[None]
                causal = cols <= rows
                window = causal & (cols > rows - 300)
                mask = {"none": None, "causal": "causal", "window": window}[kind]
                got = mx.fast.scaled_dot_product_attention(q, k, v, scale=dim**-0.5, mask=mask)
                reference = {"none": None, "causal": causal, "window": window}[kind]
                want = _reference_attention(q, k, v, dim**-0.5, reference)
                gap = float(mx.abs(got - want).max())
                if gap > 1e-3:
                    bad.append({"dim": dim, "length": length, "mask": kind, "max_diff": gap})
    return bad


def load_paths(reps: int = 3) -> dict:
    file = Path(tempfile.mkdtemp()) / "s.safetensors"
    arrays = {f"t{i}": mx.random.normal((1, 2, 16384, 256)).astype(mx.bfloat16) for i in range(16)}
    mx.save_safetensors(str(file), arrays)
    times: dict[str, list[float]] = {}

    def timed(name: str, start: float) -> None:
        times.setdefault(name, []).append((time.perf_counter() - start) * 1e3)

    def views() -> dict[str, memoryview]:
        handle = file.open("rb")
        mapped = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
        return disk._tensor_views(file, memoryview(mapped))[1]

    def copy(view: memoryview) -> mx.array:
        return mx.array(np.frombuffer(view, np.uint16))

    for _ in range(reps):
        start = time.perf_counter()
        mx.eval(list(mx.load(str(file)).values()))
        timed("mx_load", start)
        start = time.perf_counter()
        mx.eval([copy(v).view(mx.bfloat16) for v in views().values()])
        timed("np_seq", start)
        start = time.perf_counter()
        with ThreadPoolExecutor(8) as pool:
            mx.eval(list(pool.map(copy, views().values())))
        timed("np_threads", start)
        start = time.perf_counter()
        buffer = bytearray(file.stat().st_size)
        with file.open("rb", buffering=0) as handle:
            handle.readinto(buffer)
        timed("readinto_only", start)
        start = time.perf_counter()
        whole = mx.array(np.frombuffer(buffer, np.uint8))
        mx.eval(whole)
        timed("one_array_from_bytes", start)
        start = time.perf_counter()
        mx.eval(whole * 1)
        mx.synchronize()
        timed("device_touch", start)
    return {"bytes": file.stat().st_size, **times}


if __name__ == "__main__":
    mx.set_default_device(mx.gpu if mx.cuda.is_available() else mx.cpu)
    print(json.dumps({"device": str(mx.default_device()), "sdpa_mismatches": sdpa_mismatches(),
                      "loads": load_paths()}))  # fmt: skip
