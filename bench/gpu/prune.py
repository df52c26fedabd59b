"""Keeps only some GPU architectures' device code in MLX's CUDA wheel, so it fits one command.

``libmlx.so`` carries its kernels once per GPU architecture in its
``.nv_fatbin`` section (sm_75, 80, 90, 100, 120 and 121 in mlx-cuda-13
0.32, about 9 MB each of a 142 MB library), and the wheel (~90 MB) is more
than one command on the lent GPU machine may carry (64 MiB). The machines
lent are H100s and H200s, both sm_90, and the CUDA driver loads only the
entry that matches the device. So every other entry's payload is zeroed in
place: each entry's header, and so every offset and size, stays as it was
(the host code points at each container), and the zeros compress to almost
nothing in the rewritten wheel, whose ``RECORD`` line for the library is
updated. An entry is a cubin (an ELF, kind 2) or PTX (kind 1) for one
architecture; PTX is compiled only for its own architecture or a later
one, so an entry of another architecture is never what a kept one needs.

Run: ``python3 bench/gpu/prune.py WHEEL --keep 90 [--keep 100] [-o OUT]``
(``bench/gpu/wheels.sh`` runs it where ``GPU_ARCHS`` is set).
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import struct
import sys
import zipfile
from collections.abc import Iterable, Iterator
from pathlib import Path

LIBRARY = "mlx/lib/libmlx.so"
SECTION = b".nv_fatbin"
MAGIC = 0xBA55ED50  # a fatbin container's first word
CONTAINER = struct.Struct("<IHHQ")  # magic, version, header size, size of its entries
ENTRY = struct.Struct("<HHIQ")  # kind, unknown, header size, payload size
ARCH_AT = 28  # the entry's architecture (e.g. 90) within its header


def section(elf: bytes | bytearray, name: bytes) -> tuple[int, int]:
    """``(offset, size)`` in the file of the 64-bit little-endian ELF's section *name*."""
    if elf[:4] != b"\x7fELF" or elf[4] != 2 or elf[5] != 1:
        raise ValueError("not a 64-bit little-endian ELF file")
    (shoff,) = struct.unpack_from("<Q", elf, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", elf, 0x3A)
    headers = [struct.unpack_from("<IIQQQQ", elf, shoff + i * shentsize) for i in range(shnum)]
    names = headers[shstrndx][4]  # the section names' table, at its offset
    for name_at, _, _, _, offset, size in headers:
        if elf[names + name_at : names + name_at + len(name) + 1] == name + b"\0":
            return offset, size
    raise ValueError(f"no {name.decode()} section")


def entries(elf: bytes | bytearray) -> Iterator[tuple[int, int, int]]:
    """Every entry of the ELF's fatbin section: ``(architecture, offset of
    its payload in the file, payload size)``, in order."""
    start, size = section(elf, SECTION)
    at, end = start, start + size
    while at + CONTAINER.size <= end:
        magic, _, header, length = CONTAINER.unpack_from(elf, at)
        if magic != MAGIC:  # padding between containers (8-byte aligned)
            at += 8
            continue
        entry, last = at + header, at + header + length
        while entry < last:
            _, _, entry_header, payload = ENTRY.unpack_from(elf, entry)
            (arch,) = struct.unpack_from("<I", elf, entry + ARCH_AT)
            yield arch, entry + entry_header, payload
            entry += entry_header + payload
        at = (last + 7) // 8 * 8


def prune(elf: bytearray, keep: Iterable[int]) -> dict[int, int]:
    """Zero, in place, the payload of every fatbin entry whose architecture is
    not in *keep*; the bytes zeroed, by architecture."""
    keep = set(keep)
    zeroed: dict[int, int] = {}
    for arch, body, payload in entries(elf):
        if arch not in keep:
            elf[body : body + payload] = bytes(payload)
            zeroed[arch] = zeroed.get(arch, 0) + payload
    return zeroed


def _record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def prune_wheel(wheel: Path, out: Path, keep: Iterable[int]) -> dict[int, int]:
    """*wheel* rewritten to *out* with :data:`LIBRARY` pruned (:func:`prune`)
    and its ``RECORD`` line updated; the bytes zeroed, by architecture."""
    keep = tuple(keep)
    with zipfile.ZipFile(wheel) as source:
        library = bytearray(source.read(LIBRARY))
        zeroed = prune(library, keep)
        if not zeroed:
            raise ValueError(f"{wheel.name}: no device code outside {keep} to prune")
        pruned = bytes(library)
        record = _record_line(LIBRARY, pruned)
        with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as target:
            for item in source.infolist():
                data = source.read(item)
                if item.filename == LIBRARY:
                    data = pruned
                elif item.filename.endswith(".dist-info/RECORD"):
                    lines = data.decode().splitlines()
                    lines = [record if x.startswith(f"{LIBRARY},") else x for x in lines]
                    data = ("\n".join(lines) + "\n").encode()
                target.writestr(item, data, zipfile.ZIP_DEFLATED)
    return zeroed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("wheel", type=Path, help="the mlx-cuda wheel")
    parser.add_argument(
        "--keep",
        type=int,
        action="append",
        required=True,
        metavar="SM",
        help="repeatable: an architecture whose device code stays, e.g. 90 (H100, H200)",
    )
    parser.add_argument("-o", "--out", type=Path, help="the pruned wheel (default: in place)")
    args = parser.parse_args(argv)
    out = args.out or args.wheel
    partial = out.with_name(out.name + ".partial")
    try:
        zeroed = prune_wheel(args.wheel, partial, args.keep)
    except (ValueError, KeyError, zipfile.BadZipFile) as exc:
        partial.unlink(missing_ok=True)
        print(f"prune.py: {exc}", file=sys.stderr)
        return 2
    partial.replace(out)
    dropped = ", ".join(f"sm_{arch} {n / 1e6:.1f} MB" for arch, n in sorted(zeroed.items()))
    kept = ", ".join(f"sm_{arch}" for arch in args.keep)
    print(f"{out.name}: kept {kept}, zeroed {dropped}; {out.stat().st_size / 1e6:.1f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
