"""One of our CUDA kernels: its source wrapped, compiled once a machine, launched precompiled.

``mx.fast.cuda_kernel`` compiles a kernel with NVRTC in every process that
runs it, its source after MLX's device headers (CCCL, cooperative groups),
and MLX 0.32 keeps none of ours on disk: on an H100 that was most of a
gemma4 load's warm-up (docs/CUDA.md). :class:`Kernel` takes the same
arguments and wraps the same source itself, after only ``cuda_bf16.h`` and
``cuda_fp16.h``; NVRTC (:mod:`turbospark.layers.cuda.nvrtc`) builds it once
a machine, the cubin is kept under the cache directory, named by a hash of
the whole wrapped source and kept apart by architecture and NVRTC version,
and MLX launches it with ``mx.fast.precompiled_cuda_kernel``.

The wrapping follows MLX's: the inputs as typed pointers, then the outputs;
the template's values as ``constexpr`` (a dtype as ``using``). A precompiled
kernel takes only pointers and scalars, so an input's ``x_shape`` and
``x_strides``, where the source names them, arrive as int scalars after the
outputs and stand in local arrays of the same names. Every input is made
row-contiguous before the launch (copied only where it is not), so its
strides follow from its shape, which is known when the graph is built. The
shapes are then part of the launch, so a kernel here is never called inside
``mx.compile(shapeless=True)``, whose replays would keep the traced ones.
"""

from __future__ import annotations

import hashlib
import os
import re
import tempfile
import threading
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import mlx.core as mx

from turbospark.layers.cuda import nvrtc
from turbospark.paths import cache_root

TemplateValue = int | bool | mx.Dtype

C_TYPES = {
    mx.bool_: "bool",
    mx.uint8: "uint8_t",
    mx.uint16: "uint16_t",
    mx.uint32: "uint32_t",
    mx.uint64: "uint64_t",
    mx.int8: "int8_t",
    mx.int16: "int16_t",
    mx.int32: "int32_t",
    mx.int64: "int64_t",
    mx.float16: "__half",
    mx.bfloat16: "__nv_bfloat16",
    mx.float32: "float",
}
# What every kernel's source sees ahead of its header: the float types MLX
# names and the fixed-width integers (NVRTC has no <cstdint>), as glibc
# declares them on 64-bit Linux, so nvcc takes the same source.
PRELUDE = """#include <cuda_bf16.h>
#include <cuda_fp16.h>
typedef signed char int8_t;
typedef short int16_t;
typedef int int32_t;
typedef long int64_t;
typedef unsigned char uint8_t;
typedef unsigned short uint16_t;
typedef unsigned int uint32_t;
typedef unsigned long uint64_t;
"""
_NAME = "__TURBOSPARK_KERNEL__"


class Kernel:
    """``mx.fast.cuda_kernel``'s arguments and call, built as the module
    docstring says. Called with the keywords our kernels pass MLX's (no
    ``ensure_row_contiguous``: every input is; no ``init_value``: every
    kernel writes its outputs whole)."""

    def __init__(
        self,
        name: str,
        input_names: Sequence[str],
        output_names: Sequence[str],
        source: str,
        header: str = "",
    ):
        self.name = re.sub(r"\W", "_", name)
        self.input_names = list(input_names)
        self.output_names = list(output_names)
        self.body = source
        self.header = header
        # Which of each input's shape, strides and ndim the source reads.
        self._reads = [
            tuple(
                re.search(rf"\b{n}_{part}\b", source) is not None
                for part in ("shape", "strides", "ndim")
            )
            for n in self.input_names
        ]
        self._built: dict[tuple, tuple[str, bytes]] = {}

    def source(
        self,
        inputs: Sequence[tuple[mx.Dtype, int]],
        output_dtypes: Sequence[mx.Dtype],
        template: Sequence[tuple[str, TemplateValue]] = (),
    ) -> tuple[str, str]:
        """The ``extern "C"`` function's name and the whole source NVRTC
        compiles, for inputs of these ``(dtype, ndim)``."""
        params = [
            f"const {C_TYPES[dtype]}* {n}"
            for n, (dtype, _) in zip(self.input_names, inputs, strict=True)
        ]
        params += [
            f"{C_TYPES[dtype]}* {n}"
            for n, dtype in zip(self.output_names, output_dtypes, strict=True)
        ]
        locals_ = []
        for n, (_, ndim), (shape, strides, reads_ndim) in zip(
            self.input_names, inputs, self._reads, strict=True
        ):
            for used, suffix, ctype in ((shape, "shape", "int"), (strides, "strides", "long long")):
                if used and ndim:
                    scalars = [f"{n}_{suffix}{i}" for i in range(ndim)]
                    params += [f"int {s}" for s in scalars]
                    locals_.append(
                        f"    const {ctype} {n}_{suffix}[{ndim}] = {{{', '.join(scalars)}}};"
                    )
            if reads_ndim:
                locals_.append(f"    constexpr int {n}_ndim = {ndim};")
        for key, value in template:
            if isinstance(value, mx.Dtype):
                locals_.append(f"    using {key} = {C_TYPES[value]};")
            elif isinstance(value, bool):
                locals_.append(f"    constexpr bool {key} = {str(value).lower()};")
            else:
                locals_.append(f"    constexpr int {key} = {int(value)};")
        text = (
            f"{PRELUDE}{self.header}\n"
            f'extern "C" __global__ void {_NAME}(\n    {", ".join(params)}) {{\n'
            + "\n".join(locals_)
            + f"\n{self.body}\n}}\n"
        )
        name = f"{self.name}_{hashlib.sha256(text.encode()).hexdigest()[:16]}"
        return name, text.replace(_NAME, name)

    def __call__(
        self,
        *,
        inputs: Sequence[mx.array],
        output_shapes: Sequence[Sequence[int]],
        output_dtypes: Sequence[mx.Dtype],
        grid: tuple[int, int, int],
        threadgroup: tuple[int, int, int],
        template: Sequence[tuple[str, TemplateValue]] = (),
    ) -> list[mx.array]:
        signature = (
            tuple((x.dtype, x.ndim) for x in inputs),
            tuple(output_dtypes),
            tuple(template),
        )
        built = self._built.get(signature)
        if built is None:
            name, text = self.source(signature[0], output_dtypes, template)
            built = self._built[signature] = (name, cubin(name, text))
        scalars: list[int] = []
        for x, (shape, strides, _) in zip(inputs, self._reads, strict=True):
            if shape:
                scalars += x.shape
            if strides:
                scalars += _row_strides(x.shape)
        return mx.fast.precompiled_cuda_kernel(
            name=built[0],
            compiled_source=built[1],
            inputs=list(inputs),
            output_shapes=[tuple(s) for s in output_shapes],
            output_dtypes=list(output_dtypes),
            scalars=scalars,
            grid=grid,
            threadgroup=threadgroup,
            ensure_row_contiguous=True,
        )


def _row_strides(shape: Sequence[int]) -> list[int]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return strides[::-1]


def cache_dir() -> Path:
    """Where this machine's cubins are kept: apart by architecture and NVRTC version."""
    major, minor = nvrtc.version()
    return cache_root() / "kernels" / f"turbospark-{nvrtc.architecture()}-nvrtc{major}.{minor}"


# Cubins :func:`prebuild` is compiling, by name: a call that needs one waits for it.
_building: dict[str, Future[bytes]] = {}
_building_lock = threading.Lock()


def cubin(name: str, source: str) -> bytes:
    """The cubin of *source* (named *name*, which hashes it): the one
    :func:`prebuild` is compiling, else read from :func:`cache_dir` where an
    earlier process kept it, else compiled and kept (a cache directory that
    cannot be written only loses the keeping)."""
    with _building_lock:
        building = _building.get(name)
    return building.result() if building is not None else _kept_or_compiled(name, source)


def prebuild(sources: Iterable[tuple[str, str]]) -> int:
    """Start compiling, in the background, the cubins of *sources* (``(name,
    source)`` pairs, :meth:`Kernel.source`'s) that no process kept, on a
    thread a core; returns how many. NVRTC compiles on the CPU, a fraction
    of a second each, so a model whose steps need dozens of kernels (a
    packed product's, one a width and row count) would otherwise compile
    them one by one on the thread that builds the steps, on a machine's
    first launch."""
    sources = dict(sources)
    if not sources:
        return 0
    kept = cache_dir()  # asks NVRTC and the driver once, before the threads do
    with _building_lock:
        missing = {
            name: source
            for name, source in sources.items()
            if name not in _building and not (kept / f"{name}.cubin").is_file()
        }
        if not missing:
            return 0
        pool = ThreadPoolExecutor(min(len(missing), os.cpu_count() or 1), "turbospark-nvrtc")
        for name, source in missing.items():
            _building[name] = pool.submit(_kept_or_compiled, name, source)
        pool.shutdown(wait=False)
    return len(missing)


def _kept_or_compiled(name: str, source: str) -> bytes:
    path = cache_dir() / f"{name}.cubin"
    try:
        kept = path.read_bytes()
    except OSError:
        kept = b""
    if kept:
        return kept
    built = nvrtc.compile_cubin(source, name, nvrtc.architecture())
    partial = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path.parent, delete=False) as out:
            partial = out.name
            out.write(built)
        os.replace(partial, path)  # whole or absent, whatever process reads it
    except OSError:
        if partial is not None:  # a write that failed partway (a full disk)
            Path(partial).unlink(missing_ok=True)
    return built
