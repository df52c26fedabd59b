"""``bench/gpu/prune.py`` on a small ELF built here: only the other architectures' payloads change.

The real input is mlx-cuda's ``libmlx.so`` (142 MB, not in the test's
reach); here a 64-bit ELF with a ``.nv_fatbin`` section of two containers,
each a cubin for sm_80 and sm_90 and PTX for sm_120, laid out as the CUDA
toolchain lays them out (a container header, then entries of a 64-byte
header and a payload; containers 8-byte aligned).
"""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import struct
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("gpu_prune", ROOT / "bench" / "gpu" / "prune.py")
assert _spec is not None and _spec.loader is not None
prune = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(prune)

ENTRY_HEADER = 64


def _entry(kind: int, arch: int, payload: bytes) -> bytes:
    header = bytearray(ENTRY_HEADER)
    struct.pack_into("<HHIQ", header, 0, kind, 0x101, ENTRY_HEADER, len(payload))
    struct.pack_into("<I", header, prune.ARCH_AT, arch)
    return bytes(header) + payload


def _container(seed: int) -> bytes:
    entries = b"".join(
        _entry(kind, arch, bytes([seed + arch % 7 + 1]) * (40 + arch))
        for kind, arch in ((2, 80), (2, 90), (1, 120))
    )
    out = struct.pack("<IHHQ", prune.MAGIC, 1, 16, len(entries)) + entries
    return out + bytes(-len(out) % 8)


def _elf(fatbin: bytes) -> bytearray:
    """An ELF64 file: header, a text-like section, ``.nv_fatbin``, the names
    table, then the section headers (null, .text, .nv_fatbin, .shstrtab)."""
    names = b"\0.text\0.nv_fatbin\0.shstrtab\0"
    text = b"\x90" * 24
    body = bytearray(64) + text + fatbin + names
    text_at, fat_at, names_at = 64, 64 + len(text), 64 + len(text) + len(fatbin)
    shoff = len(body)
    sections = [
        (0, 0, 0),
        (1, text_at, len(text)),
        (7, fat_at, len(fatbin)),
        (18, names_at, len(names)),
    ]
    for name, offset, size in sections:
        body += struct.pack("<IIQQQQIIQQ", name, 1, 0, 0, offset, size, 0, 0, 8, 0)
    body[:4] = b"\x7fELF"
    body[4:7] = bytes([2, 1, 1])
    struct.pack_into("<Q", body, 0x28, shoff)
    struct.pack_into("<HHH", body, 0x3A, 64, len(sections), 3)  # shentsize, shnum, shstrndx
    return body


def _payloads(elf: bytes | bytearray) -> list[tuple[int, bytes]]:
    """Each entry's (architecture, payload), in order."""
    return [(arch, bytes(elf[at : at + size])) for arch, at, size in prune.entries(elf)]


def test_only_other_architectures_payloads_are_zeroed() -> None:
    original = _elf(_container(1) + _container(2))
    elf = bytearray(original)
    zeroed = prune.prune(elf, [90])
    assert zeroed == {80: 2 * 120, 120: 2 * 160}
    assert len(elf) == len(original)
    before, after = _payloads(original), _payloads(elf)
    assert [arch for arch, _ in after] == [80, 90, 120, 80, 90, 120]  # every header as it was
    for (arch, old), (_, new) in zip(before, after, strict=True):
        assert new == (old if arch == 90 else bytes(len(old)))
    # Nothing outside the payloads changed: the bytes differ exactly where they were zeroed.
    changed = sum(a != b for a, b in zip(original, elf, strict=True))
    assert changed == sum(len(old) for arch, old in before if arch != 90)


def test_keeping_every_architecture_changes_nothing() -> None:
    original = _elf(_container(3))
    elf = bytearray(original)
    assert prune.prune(elf, [80, 90, 120]) == {}
    assert elf == original


def test_the_wheel_is_rewritten_with_its_record_line(tmp_path: Path) -> None:
    library = bytes(_elf(_container(4)))
    record_name = "mlx_cuda-0.0.dist-info/RECORD"
    wheel = tmp_path / "mlx_cuda-0.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as out:
        out.writestr(prune.LIBRARY, library)
        out.writestr("mlx/include/mlx.h", "")
        out.writestr(
            record_name, f"{prune.LIBRARY},sha256=stale,{len(library)}\nmlx/include/mlx.h,,\n"
        )
    assert prune.main([str(wheel), "--keep", "90"]) == 0
    with zipfile.ZipFile(wheel) as pruned:
        data = pruned.read(prune.LIBRARY)
        record = pruned.read(record_name).decode().splitlines()
        assert pruned.read("mlx/include/mlx.h") == b""
    assert [arch for arch, payload in _payloads(data) if any(payload)] == [90]
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    assert record == [f"{prune.LIBRARY},sha256={digest},{len(data)}", "mlx/include/mlx.h,,"]


def test_a_wheel_with_nothing_to_prune_is_refused_and_left_alone(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    wheel = tmp_path / "w.whl"
    with zipfile.ZipFile(wheel, "w") as out:
        out.writestr(prune.LIBRARY, bytes(_elf(_container(5))))
    before = wheel.read_bytes()
    assert prune.main([str(wheel), "--keep", "80", "--keep", "90", "--keep", "120"]) == 2
    assert "no device code outside" in capsys.readouterr().err
    assert wheel.read_bytes() == before
    assert not list(tmp_path.glob("*.partial"))
    not_elf = tmp_path / "x.whl"
    with zipfile.ZipFile(not_elf, "w") as out:
        out.writestr(prune.LIBRARY, b"plain text")
    assert prune.main([str(not_elf), "--keep", "90"]) == 2
    assert "not a 64-bit little-endian ELF file" in capsys.readouterr().err
