"""How our CUDA kernels are wrapped, compiled once a machine, kept and launched (``turbospark.layers.cuda.kernel``).

On the CPU: NVRTC and MLX's launch are replaced by recorders, so these check
what reaches them. ``tests/test_cuda_sources.py`` compiles every real
kernel's source; the GPU tests run them.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest

from turbospark.layers.cuda import kernel as kernel_module
from turbospark.layers.cuda import nvrtc
from turbospark.layers.cuda.kernel import Kernel

SOURCE = "    out[0] = static_cast<float>(x[x_strides[1]]) + y[y_shape[0] - 1] * N;"


@pytest.fixture
def compiles(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[str]:
    """NVRTC's compiles, by name (each returns a stand-in binary), under a cache of tmp_path's."""
    done: list[str] = []

    def compile_cubin(source: str, name: str, arch: str) -> bytes:
        done.append(name)
        return f"{arch}:{name}".encode()

    monkeypatch.setenv("TURBOSPARK_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(nvrtc, "compile_cubin", compile_cubin)
    monkeypatch.setattr(nvrtc, "version", lambda: (13, 0))
    monkeypatch.setattr(nvrtc, "architecture", lambda: "sm_90")
    monkeypatch.setattr(kernel_module, "_building", {})
    return done


@pytest.fixture
def launches(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    calls: list[dict[str, Any]] = []

    def launch(**kwargs: Any) -> list[mx.array]:
        calls.append(kwargs)
        return [
            mx.zeros(s, dtype=d)
            for s, d in zip(kwargs["output_shapes"], kwargs["output_dtypes"], strict=True)
        ]

    monkeypatch.setattr(mx.fast, "precompiled_cuda_kernel", launch)
    return calls


def test_the_source_is_wrapped_as_mlx_wraps_it() -> None:
    kernel = Kernel("k", ["x", "y"], ["out"], SOURCE, header="// header")

    def source(x: mx.Dtype = mx.bfloat16, n: int = 3) -> tuple[str, str]:
        return kernel.source(
            [(x, 3), (mx.float32, 1)], [mx.float32], [("N", n), ("F", True), ("T", mx.float16)]
        )

    name, text = source()
    assert text.startswith(kernel_module.PRELUDE + "// header\n")
    signature = (
        f'extern "C" __global__ void {name}(\n    const __nv_bfloat16* x, const float* y, '
        "float* out, int x_strides0, int x_strides1, int x_strides2, int y_shape0) {"
    )
    assert signature in text
    for line in (
        "const long long x_strides[3] = {x_strides0, x_strides1, x_strides2};",
        "const int y_shape[1] = {y_shape0};",
        "constexpr int N = 3;",
        "constexpr bool F = true;",
        "using T = __half;",
    ):
        assert f"\n    {line}\n" in text
    assert "x_shape" not in text and "_ndim" not in text
    assert name.startswith("k_")
    # The name hashes the whole source: another template or dtype is another kernel.
    assert source()[0] == name
    assert source(n=4)[0] != name
    assert source(x=mx.float32)[0] != name


def test_a_launch_passes_shapes_and_row_strides_and_makes_inputs_contiguous(
    compiles: list[str], launches: list[dict[str, Any]]
) -> None:
    kernel = Kernel("k", ["x", "y"], ["out"], SOURCE)
    x = mx.zeros((4, 3, 2)).transpose(2, 0, 1)  # (2, 4, 3), not row-contiguous
    y = mx.zeros((5,))
    for _ in range(2):
        (out,) = kernel(
            inputs=[x, y], template=[("N", 2)], grid=(32, 1, 1), threadgroup=(32, 1, 1),
            output_shapes=[(1,)], output_dtypes=[mx.float32],
        )  # fmt: skip
    assert out.shape == (1,)
    call = launches[-1]
    assert call["scalars"] == [12, 3, 1, 5]  # x's row strides for (2, 4, 3), then y's shape
    assert call["ensure_row_contiguous"] is True
    assert call["name"] == compiles[0]
    assert call["compiled_source"] == f"sm_90:{compiles[0]}".encode()
    assert len(compiles) == 1  # built once a process for one signature
    kernel(
        inputs=[x.astype(mx.bfloat16), y], template=[("N", 2)], grid=(32, 1, 1),
        threadgroup=(32, 1, 1), output_shapes=[(1,)], output_dtypes=[mx.float32],
    )  # fmt: skip
    assert len(compiles) == 2 and launches[-1]["name"] != launches[0]["name"]


def test_cubins_are_kept_on_disk_and_read_by_the_next_process(compiles: list[str]) -> None:
    assert kernel_module.cubin("k_1", "source one") == b"sm_90:k_1"
    kept = kernel_module.cache_dir() / "k_1.cubin"
    assert kept.read_bytes() == b"sm_90:k_1"
    assert kernel_module.cache_dir().name == "turbospark-sm_90-nvrtc13.0"
    # Another process (no in-memory kernel) reads the file and compiles nothing.
    assert kernel_module.cubin("k_1", "source one") == b"sm_90:k_1"
    assert compiles == ["k_1"]
    assert kernel_module.cubin("k_2", "source two") == b"sm_90:k_2"
    assert compiles == ["k_1", "k_2"]
    # An empty file (a write that never finished elsewhere) is compiled anew.
    kept.write_bytes(b"")
    assert kernel_module.cubin("k_1", "source one") == b"sm_90:k_1"
    assert compiles == ["k_1", "k_2", "k_1"]


def test_a_cache_that_cannot_be_written_only_loses_the_keeping(
    compiles: list[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    monkeypatch.setenv("TURBOSPARK_CACHE", str(blocked))
    for _ in range(2):
        assert kernel_module.cubin("k_1", "source one") == b"sm_90:k_1"
    assert compiles == ["k_1", "k_1"]


def test_a_write_that_fails_partway_leaves_no_file_behind(
    compiles: list[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A full disk: the cubin still comes back, the cache folder holds
    nothing half-written, and the next call compiles again."""
    monkeypatch.setenv("TURBOSPARK_CACHE", str(tmp_path))

    def full(path: str, target: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(kernel_module.os, "replace", full)
    for _ in range(2):
        assert kernel_module.cubin("k_1", "source one") == b"sm_90:k_1"
    assert compiles == ["k_1", "k_1"]
    assert [p for p in tmp_path.rglob("*") if p.is_file()] == []


def test_prebuild_compiles_what_no_process_kept_and_a_call_waits_for_it(
    compiles: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Started in the background, it compiles only the cubins not kept; a
    call that needs one meanwhile waits for it (compiled once, not again),
    and a second prebuild of the same sources starts nothing."""
    assert kernel_module.cubin("kept", "source kept") == b"sm_90:kept"
    gate = threading.Event()
    compile_cubin = nvrtc.compile_cubin

    def held(source: str, name: str, arch: str) -> bytes:
        gate.wait(timeout=10)
        return compile_cubin(source, name, arch)

    monkeypatch.setattr(nvrtc, "compile_cubin", held)
    sources = [("kept", "source kept"), ("a", "source a"), ("b", "source b")]
    assert kernel_module.prebuild(sources) == 2
    assert kernel_module.prebuild(sources) == 0  # in flight
    got: list[bytes] = []
    waiter = threading.Thread(target=lambda: got.append(kernel_module.cubin("a", "source a")))
    waiter.start()
    waiter.join(timeout=0.2)
    assert waiter.is_alive() and not got  # waiting for the background compile
    gate.set()
    waiter.join(timeout=10)
    assert got == [b"sm_90:a"]
    assert kernel_module.cubin("b", "source b") == b"sm_90:b"
    assert sorted(compiles) == ["a", "b", "kept"]
    assert (kernel_module.cache_dir() / "b.cubin").read_bytes() == b"sm_90:b"


def test_a_prebuilt_source_that_does_not_compile_fails_the_call_that_needs_it(
    compiles: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(source: str, name: str, arch: str) -> bytes:
        raise nvrtc.CompileError(f"{name} does not compile:\nerror: expected a ';'")

    monkeypatch.setattr(nvrtc, "compile_cubin", refuse)
    assert kernel_module.prebuild([("bad", "source")]) == 1
    with pytest.raises(nvrtc.CompileError, match="bad does not compile"):
        kernel_module.cubin("bad", "source")


def test_nvrtc_missing_says_how_to_point_at_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(nvrtc, "_candidates", lambda: ["/nowhere/libnvrtc.so"])
    nvrtc.library.cache_clear()
    try:
        with pytest.raises(OSError, match="TURBOSPARK_NVRTC"):
            nvrtc.library()
    finally:
        nvrtc.library.cache_clear()


def test_no_cuda_headers_says_where_to_point(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(nvrtc, "include_dirs", lambda: ())
    with pytest.raises(nvrtc.CompileError, match="CUDA_HOME"):
        nvrtc.compile_cubin("", "k", "sm_90")
