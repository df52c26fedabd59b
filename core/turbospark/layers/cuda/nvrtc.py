"""NVRTC, the CUDA runtime compiler, through ctypes: a kernel's source to a cubin.

The library is the one MLX's CUDA backend links and has already loaded, so
this adds no dependency; ctypes releases the GIL while it compiles. The
headers our kernels include (``cuda_bf16.h``, ``cuda_fp16.h``) come from the
CUDA toolkit MLX's own compiles use (``$CUDA_HOME``, ``$CUDA_PATH`` or
``/usr/local/cuda``), or from NVIDIA's pip packages, and CCCL where MLX
ships it. ``TURBOSPARK_NVRTC`` names the library where none of those find it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import sys
from pathlib import Path

import mlx.core as mx


class CompileError(RuntimeError):
    """NVRTC refused a source: the message is its log."""


@functools.cache
def library() -> ctypes.CDLL:
    """The NVRTC library: ``$TURBOSPARK_NVRTC``, else the one this process
    loaded (MLX's), else the loader's and NVIDIA's pip packages'."""
    for path in _candidates():
        try:
            return ctypes.CDLL(path)
        except OSError:
            continue
    raise OSError(
        "NVRTC (libnvrtc.so) not found: install the CUDA toolkit or NVIDIA's nvidia-cuda-nvrtc "
        "package, or set TURBOSPARK_NVRTC to the library's path"
    )


def _candidates() -> list[str]:
    found = [os.environ["TURBOSPARK_NVRTC"]] if os.environ.get("TURBOSPARK_NVRTC") else []
    maps = Path("/proc/self/maps")
    if maps.exists():
        for line in maps.read_text().splitlines():
            path = line.split(maxsplit=5)[-1]
            if "/libnvrtc.so" in path and path not in found:
                found.append(path)
    if name := ctypes.util.find_library("nvrtc"):
        found.append(name)
    for entry in map(Path, sys.path):
        found += sorted(str(p) for p in entry.glob("nvidia/*/lib/libnvrtc.so*"))
    return [*found, "libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"]


def version() -> tuple[int, int]:
    major, minor = ctypes.c_int(), ctypes.c_int()
    _check(library().nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)), "nvrtcVersion")
    return major.value, minor.value


@functools.cache
def include_dirs() -> tuple[str, ...]:
    """Where ``cuda_bf16.h`` is (and CCCL beside MLX), as MLX's compiles
    look; none where no ``cuda_bf16.h`` is found."""
    roots = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    dirs = [Path(r) / "include" for r in roots if r]
    for entry in map(Path, sys.path):
        dirs += sorted(entry.glob("nvidia/*/include"))
    headers = [str(d) for d in dirs if (d / "cuda_bf16.h").exists()][:1]
    cccl = Path(mx.__file__).parent / "include" / "cccl"
    return () if not headers else (*headers, *([str(cccl)] if cccl.is_dir() else []))


@functools.cache
def architecture() -> str:
    """``sm_XY`` of CUDA device 0 (MLX's default device), from the driver."""
    driver = ctypes.CDLL("libcuda.so.1")
    _check_driver(driver.cuInit(0), "cuInit")
    device, major, minor = ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
    _check_driver(driver.cuDeviceGet(ctypes.byref(device), 0), "cuDeviceGet")
    for value, attribute in ((major, 75), (minor, 76)):  # CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_*
        _check_driver(
            driver.cuDeviceGetAttribute(ctypes.byref(value), attribute, device),
            "cuDeviceGetAttribute",
        )
    return f"sm_{major.value}{minor.value}"


def compile_cubin(source: str, name: str, arch: str) -> bytes:
    """*source*'s cubin for *arch* (``sm_90``); :class:`CompileError` with
    NVRTC's log where it does not compile."""
    if not include_dirs():
        raise CompileError(
            "cuda_bf16.h not found: set CUDA_HOME to the CUDA toolkit MLX's CUDA backend uses"
        )
    nvrtc = library()
    program = ctypes.c_void_p()
    _check(
        nvrtc.nvrtcCreateProgram(
            ctypes.byref(program), source.encode(), f"{name}.cu".encode(), 0, None, None
        ),
        "nvrtcCreateProgram",
    )
    try:
        options = [f"--gpu-architecture={arch}", "-std=c++17"]
        options += [f"--include-path={d}" for d in include_dirs()]
        encoded = (ctypes.c_char_p * len(options))(*(o.encode() for o in options))
        if nvrtc.nvrtcCompileProgram(program, len(options), encoded) != 0:
            size = ctypes.c_size_t()
            nvrtc.nvrtcGetProgramLogSize(program, ctypes.byref(size))
            log = ctypes.create_string_buffer(size.value)
            nvrtc.nvrtcGetProgramLog(program, log)
            raise CompileError(f"{name} does not compile:\n{log.value.decode(errors='replace')}")
        size = ctypes.c_size_t()
        _check(nvrtc.nvrtcGetCUBINSize(program, ctypes.byref(size)), "nvrtcGetCUBINSize")
        cubin = ctypes.create_string_buffer(size.value)
        _check(nvrtc.nvrtcGetCUBIN(program, cubin), "nvrtcGetCUBIN")
        return cubin.raw
    finally:
        nvrtc.nvrtcDestroyProgram(ctypes.byref(program))


def _check(result: int, call: str) -> None:
    if result != 0:
        describe = library().nvrtcGetErrorString
        describe.restype = ctypes.c_char_p
        raise CompileError(f"{call} failed: {describe(result).decode()}")


def _check_driver(result: int, call: str) -> None:
    if result != 0:
        raise RuntimeError(f"{call} failed with CUDA driver error {result}")
