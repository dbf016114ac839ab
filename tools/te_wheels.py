#!/usr/bin/env python3
"""Transformer Engine for an offline GPU node, made on any Linux x86-64 CPU machine (issue #42).

The GPU node has no network; ``transformer-engine-torch`` is published only as source, and the
core wheel (``transformer-engine-cu13``, 276 MB) carries device code for eight GPU architectures.
``build`` fills a wheel folder (e.g. ../te_wheels) with everything tools/gpu_check.sh needs to run
the Transformer Engine layers there, and nothing the node already has:

  * transformer-engine-torch, built from its sdist against the node's exact torch (a C++
    extension: it needs the CUDA, cuDNN and NCCL headers -- from NVIDIA's wheels -- not nvcc and
    not a GPU), in a build venv outside the checkout (--work);
  * transformer-engine-cu13 with its fat binaries trimmed to the node's GPU architecture (every
    kept image checked byte for byte against the original, nothing else in the library changed,
    the wheel's RECORD rewritten): 276 -> about 31 MB for sm_90;
  * transformer-engine (the Python wheel) at the same version (TE refuses mixed versions);
  * what those and tools/gpu_check.sh --requirements (megatron-core, pytest-timeout, ...) require,
    for the node's platform (Linux x86-64, CPython 3.12), except what the node has.

Read the node's Python, torch, GPU architecture and packages in one command, on the node (the
command is printed at the end of this help, and quoted in docs/gpu.md), into node.txt;
then, here (the full build: about 15 CPU-minutes -- 11 minutes on two shared cores -- and 5 GB of
downloads; docs/transformer-engine.md has the measurements):

  tools/te_wheels.py build ../te_wheels --node node.txt
  tools/te_wheels.py build ../te_wheels --torch 2.11.0+cu130 --arch sm_90    # without the list

and carry ../te_wheels beside the checkout: tools/gpu_check.sh finds it (or WHEELS=/path/to/it),
installs it and runs the GPU suite and the benchmark on TE layers. Without --node the folder
holds every requirement except torch and what the node's torch guarantees (the floor of its own
requirements), which for the GPU check comes to about 90 MiB: the list is what keeps it small.

Parts, for a core wheel or library at hand:

  tools/te_wheels.py trim transformer_engine_cu13-2.20.2-...whl --arch sm_90 --out DIR
  tools/te_wheels.py verify ORIGINAL TRIMMED --arch sm_90     # two wheels or two .so files

Trimming: the ELF section .nv_fatbin holds fat-binary containers (header: u32 magic 0xBA55ED50,
u16 version, u16 header size, u64 body size), each a run of entries (u16 kind -- 1 PTX, 2 ELF
cubin --, u16 version, u32 header size, u64 padded payload size, ..., u32 SM number at byte 28).
In every container the cubins (kind 2) for the chosen SM -- sm_90 and sm_90a alike -- are kept,
moved to the front in their order, the container's body size shrunk and the freed bytes zeroed;
PTX is dropped (the driver needs it only where no cubin for the GPU exists, which this trim
refuses), except in a container with no cubin for the SM, whose PTX for that SM is kept (the
driver compiles it once). A container with neither stops the trim, naming its offset and the SMs
it has. Every container keeps its address (the host code registers it by address), so the file's
size and layout do not change; the zeros compress away in the wheel.

The pin, TE 2.20.2 (--te-version): megatron-core 0.19.2's own version checks stop at TE 2.14, so
its TE imports were checked against TE 2.14.0, 2.17.0, 2.18.0 and 2.20.2 (static, every
`from transformer_engine... import` in megatron/core, and the keyword arguments its TE layer
wrappers pass to te.pytorch.Linear, LayerNormLinear, DotProductAttention and the norms): with
2.20.2 and 2.18.0 nothing unguarded is missing; three guarded imports fail on every one of those
versions alike, each with megatron-core's own fallback (_SplitAlongDim: torch.split;
attention.apply_rotary_pos_emb: for TE < 2.3 only; module.base.get_workspace: None); 2.14 and
2.17 lack transformer_engine.pytorch.ep and the grouped-linear buffer keys that megatron-core's
MoE code imports. So the newest, 2.20.2; 2.18.0 is the fall-back if the node shows otherwise.

Exit status: 0 when the folder is complete and within --max-mib (trim/verify: when they hold);
1 when the work failed (a download or the build, a trim refused, a verification, the size limit),
with an error: line saying what and what to change; 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import base64
import csv
import datetime
import email.parser
import hashlib
import io
import os
import re
import shutil
import struct
import subprocess
import sys
import tarfile
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Optional

try:
    from packaging.requirements import Requirement
    from packaging.specifiers import SpecifierSet
    from packaging.utils import canonicalize_name, parse_wheel_filename
    from packaging.version import InvalidVersion, Version
except ImportError:  # pip always carries a copy
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.specifiers import SpecifierSet
    from pip._vendor.packaging.utils import canonicalize_name, parse_wheel_filename
    from pip._vendor.packaging.version import InvalidVersion, Version

REPO = Path(__file__).resolve().parent.parent
TE_VERSION = "2.20.2"
"""The pinned Transformer Engine (the module docstring says why)."""
NODE_COMMAND = ("python3 -c \"import torch, platform, importlib.metadata as m; "
                "print('node: python', platform.python_version(), 'torch', torch.__version__, "
                "'arch', 'sm_%d%d' % torch.cuda.get_device_capability()); "
                "[print(f'{d.name}=={d.version}') for d in m.distributions()]\" > node.txt")
"""On the node: its Python, torch, GPU architecture and packages, for --node (what :func:`read_node` reads)."""
MAX_MIB = 60
"""Default size limit of the folder: what travels to a node is at most 64 MiB with the checkout."""


class ToolError(Exception):
    """The work failed (exit status 1); the message says what and what to change."""


class UsageError(ToolError):
    """Bad arguments (exit status 2)."""


# ===================================================================== ELF and fat binaries
FATBIN_MAGIC = 0xBA55ED50
MAGIC_BYTES = struct.pack("<I", FATBIN_MAGIC)
FATBIN_HEADER = struct.Struct("<IHHQ")  # magic, version, header size, body size
ENTRY_HEADER = struct.Struct("<HHIQ")  # kind, version, header size, padded payload size
ENTRY_SM_OFFSET = 28  # u32: the SM number (90 for sm_90 and sm_90a)
KIND_PTX, KIND_ELF = 1, 2
KIND_NAMES = {KIND_PTX: "PTX", KIND_ELF: "cubin"}
ELF_SECTION = struct.Struct("<IIQQQQIIQQ")  # name, type, flags, addr, offset, size, link, info, addralign, entsize
SHT_NOBITS = 8


@dataclass(frozen=True)
class Section:
    name: str
    offset: int
    size: int


@dataclass(frozen=True)
class Entry:
    """One image of a fat-binary container: its place in the file and what it is."""

    offset: int
    """File offset of the entry's header."""
    size: int
    """Header plus padded payload, in bytes."""
    kind: int
    sm: int

    @property
    def label(self) -> str:
        return f"{KIND_NAMES.get(self.kind, f'kind {self.kind}')} sm_{self.sm}"


@dataclass(frozen=True)
class Container:
    offset: int
    """File offset of the container's header."""
    header_size: int
    body_size: int
    entries: tuple[Entry, ...]

    @property
    def end(self) -> int:
        return self.offset + self.header_size + self.body_size

    def sms(self) -> str:
        kinds = sorted({(e.sm, e.kind != KIND_ELF, e.label) for e in self.entries})  # by SM, cubins first
        return ", ".join(label for _, _, label in kinds) or "no entries"


def elf_sections(data: bytes, what: str = "the file") -> dict[str, Section]:
    """The named sections of an ELF64 little-endian file (``what`` names it in errors)."""
    if data[:4] != b"\x7fELF":
        raise ToolError(f"{what} is not an ELF file (it starts with {data[:4]!r})")
    if data[4] != 2 or data[5] != 1:
        raise ToolError(f"{what} is not a 64-bit little-endian ELF file (class {data[4]}, data {data[5]}): "
                        f"only Linux x86-64 libraries are trimmed")
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    if shoff == 0 or shentsize != ELF_SECTION.size or shoff + ELF_SECTION.size > len(data):
        raise ToolError(f"{what} has no section header table (e_shoff {shoff}, e_shentsize {shentsize})")
    first = ELF_SECTION.unpack_from(data, shoff)
    if shnum == 0:  # extended numbering: the count is section 0's size
        shnum = first[5]
    if shstrndx == 0xFFFF:  # SHN_XINDEX: the index is section 0's link
        shstrndx = first[6]
    if shoff + shnum * ELF_SECTION.size > len(data) or shstrndx >= shnum:
        raise ToolError(f"{what}: the section header table ({shnum} sections at {shoff}) runs past the end of the file")
    headers = [ELF_SECTION.unpack_from(data, shoff + i * ELF_SECTION.size) for i in range(shnum)]
    strtab = headers[shstrndx]
    names = data[strtab[4]:strtab[4] + strtab[5]]
    sections = {}
    for header in headers:
        name_end = names.find(b"\0", header[0])
        name = names[header[0]:name_end].decode("ascii", "replace")
        if name and header[1] != SHT_NOBITS:
            sections[name] = Section(name, header[4], header[5])
    return sections


def fatbin_section(data: bytes, what: str = "the file") -> Section:
    section = elf_sections(data, what).get(".nv_fatbin")
    if section is None:
        raise ToolError(f"{what} has no .nv_fatbin section: it holds no CUDA device code to trim")
    if section.offset + section.size > len(data):
        raise ToolError(f"{what}: .nv_fatbin ({section.size} bytes at {section.offset}) runs past the end of the file")
    return section


def fatbin_containers(data: bytes, section: Section) -> list[Container]:
    """The containers of a .nv_fatbin section, in order; zero bytes between them are padding."""
    containers, offset, end = [], section.offset, section.offset + section.size
    while offset < end:
        if data[offset] == 0:  # padding up to the next container (or the section's end): zeros only
            following = data.find(MAGIC_BYTES, offset, end)
            following = end if following < 0 else following
            gap = data[offset:following]
            rest = gap.lstrip(b"\0")
            if rest:
                offset += len(gap) - len(rest)
            else:
                offset = following
                continue
        if offset + FATBIN_HEADER.size > end:
            raise ToolError(f".nv_fatbin: stray bytes at offset {offset:#x} (no room for a container header)")
        magic, _version, header_size, body_size = FATBIN_HEADER.unpack_from(data, offset)
        if magic != FATBIN_MAGIC:
            raise ToolError(f".nv_fatbin: no fat-binary container at offset {offset:#x}: magic {magic:#010x}, "
                            f"expected {FATBIN_MAGIC:#010x} (a corrupt library, or a fat-binary layout this tool does not know)")
        if header_size < FATBIN_HEADER.size or offset + header_size + body_size > end:
            raise ToolError(f".nv_fatbin: the container at offset {offset:#x} (header {header_size}, body {body_size} bytes) "
                            f"runs past the section's end at {end:#x}")
        body_end = offset + header_size + body_size
        entries = fatbin_entries(data, offset, offset + header_size, body_end)
        containers.append(Container(offset, header_size, body_size, entries))
        offset = body_end
    return containers


def fatbin_entries(data: bytes, container: int, start: int, end: int) -> tuple[Entry, ...]:
    """The entries of the container at offset ``container``, whose body spans ``start``-``end``."""
    entries, at = [], start
    while at < end:
        if at + ENTRY_SM_OFFSET + 4 > end:
            raise ToolError(f".nv_fatbin: the container at offset {container:#x} ends inside an entry header at {at:#x}")
        kind, _, entry_header, payload = ENTRY_HEADER.unpack_from(data, at)
        sm, = struct.unpack_from("<I", data, at + ENTRY_SM_OFFSET)
        size = entry_header + payload
        if entry_header < ENTRY_SM_OFFSET + 4 or at + size > end:
            raise ToolError(f".nv_fatbin: the entry at {at:#x} of the container at {container:#x} (header {entry_header}, "
                            f"payload {payload} bytes) does not fit its container")
        entries.append(Entry(at, size, kind, sm))
        at += size
    return tuple(entries)


def kept_entries(container: Container, sm: int) -> list[Entry]:
    """What a container keeps for ``sm``: its cubins for that SM; PTX for it only if it has none."""
    cubins = [e for e in container.entries if e.kind == KIND_ELF and e.sm == sm]
    return cubins or [e for e in container.entries if e.kind == KIND_PTX and e.sm == sm]


@dataclass
class TrimReport:
    containers: int = 0
    kept: int = 0
    dropped: int = 0
    kept_bytes: int = 0
    freed_bytes: int = 0
    kinds: dict = field(default_factory=dict)
    """{'cubin sm_90': count, ...} of the kept entries."""
    ptx_only: int = 0
    """Containers with no cubin for the SM whose PTX was kept."""


def trim_library(data: bytes, sm: int, what: str = "the library") -> tuple[bytes, TrimReport]:
    """``data`` (an ELF shared object) with every fat-binary container trimmed to ``sm``."""
    section = fatbin_section(data, what)
    containers = fatbin_containers(data, section)
    if not containers:
        raise ToolError(f"{what}: .nv_fatbin holds no fat-binary container")
    missing = [c for c in containers if not kept_entries(c, sm)]
    if missing:
        shown = "; ".join(f"offset {c.offset:#x}: {c.sms()}" for c in missing[:5])
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise ToolError(f"{what}: {len(missing)} of {len(containers)} fat-binary containers have no image for sm_{sm} -- {shown}{more}: "
                        f"this library cannot run on sm_{sm}; choose an architecture every container has (--arch), or carry it untrimmed")
    out = bytearray(data)
    report = TrimReport(containers=len(containers))
    for container in containers:
        keep = kept_entries(container, sm)
        body = b"".join(data[e.offset:e.offset + e.size] for e in keep)
        start = container.offset + container.header_size
        out[start:container.end] = body + bytes(container.body_size - len(body))
        struct.pack_into("<Q", out, container.offset + 8, len(body))
        report.kept += len(keep)
        report.dropped += len(container.entries) - len(keep)
        report.kept_bytes += len(body)
        report.freed_bytes += container.body_size - len(body)
        report.ptx_only += keep[0].kind == KIND_PTX
        for entry in keep:
            report.kinds[entry.label] = report.kinds.get(entry.label, 0) + 1
    return bytes(out), report


def first_difference(a: bytes, b: bytes, start: int, end: int, chunk: int = 1 << 20) -> Optional[int]:
    """The first offset in ``start``-``end`` where ``a`` and ``b`` differ, or None."""
    for at in range(start, end, chunk):
        stop = min(at + chunk, end)
        if a[at:stop] != b[at:stop]:
            return next(i for i in range(at, stop) if a[i] != b[i])
    return None


def verify_trim(original: bytes, trimmed: bytes, sm: int, what: str = "the library") -> int:
    """Check ``trimmed`` against ``original`` independently of how it was made: the same size and
    the same bytes outside .nv_fatbin; each container at its address, holding exactly the images
    :func:`kept_entries` selects from the original's, byte for byte and in order, then zeros.
    Returns the number of images checked; raises ToolError naming the first difference."""
    if len(original) != len(trimmed):
        raise ToolError(f"{what}: the trimmed library is {len(trimmed)} bytes, the original {len(original)}")
    section = fatbin_section(original, what)
    if fatbin_section(trimmed, what) != section:
        raise ToolError(f"{what}: .nv_fatbin moved or changed size")
    lo, hi = section.offset, section.offset + section.size
    for a, b in ((0, lo), (hi, len(original))):
        where = first_difference(original, trimmed, a, b)
        if where is not None:
            raise ToolError(f"{what}: byte {where:#x}, outside .nv_fatbin, differs from the original")
    before = fatbin_containers(original, section)
    checked = 0
    for old in before:  # the trimmed library's container at each of the original's addresses
        magic, _, header_size, body_size = FATBIN_HEADER.unpack_from(trimmed, old.offset)
        header = slice(old.offset, old.offset + 8), slice(old.offset + 16, old.offset + old.header_size)
        if magic != FATBIN_MAGIC or any(original[part] != trimmed[part] for part in header):
            raise ToolError(f"{what}: the header of the container at {old.offset:#x} changed beyond its body size")
        if body_size > old.body_size:
            raise ToolError(f"{what}: the container at {old.offset:#x} grew ({body_size} bytes, the original {old.body_size})")
        start = old.offset + header_size
        entries = fatbin_entries(trimmed, old.offset, start, start + body_size)
        keep = kept_entries(old, sm)
        if len(entries) != len(keep):
            raise ToolError(f"{what}: the container at {old.offset:#x} holds {len(entries)} images, expected {len(keep)} ({old.sms()})")
        for want, got in zip(keep, entries):
            if original[want.offset:want.offset + want.size] != trimmed[got.offset:got.offset + got.size]:
                raise ToolError(f"{what}: the {got.label} image at {got.offset:#x} differs from the original's at {want.offset:#x}")
            checked += 1
        if trimmed[start + body_size:old.end].strip(b"\0"):
            raise ToolError(f"{what}: the freed bytes of the container at {old.offset:#x} are not zero")
    gaps = zip([lo] + [c.end for c in before], [c.offset for c in before] + [hi])
    if any(original[a:b] != trimmed[a:b] for a, b in gaps):
        raise ToolError(f"{what}: the padding between containers changed")
    return checked


# ===================================================================== wheels: RECORD, trim, verify
def record_hash(data: bytes) -> str:
    """A RECORD hash (the wheel spec: urlsafe base64 of the sha256 digest, no padding)."""
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def _dist_info(names: Iterable[str]) -> str:
    found = {n.split("/")[0] for n in names if re.fullmatch(r"[^/]+\.dist-info/RECORD", n)}
    if len(found) != 1:
        raise ToolError(f"expected one .dist-info folder with a RECORD, found {sorted(found) or 'none'}")
    return found.pop()


def check_record(path: Path) -> int:
    """Every file of the wheel at ``path`` has the hash and size its RECORD states, and RECORD lists
    every file; returns the number of files checked."""
    with zipfile.ZipFile(path) as archive:
        names = [i.filename for i in archive.infolist() if not i.is_dir()]
        record_name = _dist_info(names) + "/RECORD"
        rows = {row[0]: row for row in csv.reader(io.StringIO(archive.read(record_name).decode())) if row}
        if set(rows) != set(names):
            raise ToolError(f"{path.name}: RECORD and the archive disagree: {sorted(set(rows) ^ set(names))[:5]}")
        for name in names:
            if name == record_name:
                continue
            data = archive.read(name)
            if rows[name][1] != record_hash(data) or rows[name][2] != str(len(data)):
                raise ToolError(f"{path.name}: {name} does not match its RECORD entry ({rows[name][1]}, {rows[name][2]} bytes)")
    return len(names) - 1


def rewrite_wheel(source: Path, target: Path, replace: dict[str, bytes]) -> None:
    """Copy the wheel ``source`` to ``target`` with the files in ``replace`` replaced, and a RECORD
    whose lines for those files (and WHEEL, if replaced) carry their new hash and size."""
    with zipfile.ZipFile(source) as archive:
        infos = archive.infolist()
        record_name = _dist_info(i.filename for i in infos) + "/RECORD"
        unknown = set(replace) - {i.filename for i in infos}
        if unknown:
            raise ToolError(f"{source.name} has no {sorted(unknown)}")
        rows = [row for row in csv.reader(io.StringIO(archive.read(record_name).decode())) if row]
        for row in rows:
            if row[0] in replace:
                row[1:3] = [record_hash(replace[row[0]]), str(len(replace[row[0]]))]
        record = io.StringIO()
        csv.writer(record, lineterminator="\n").writerows(rows)
        partial = target.with_name(target.name + ".part")
        with zipfile.ZipFile(partial, "w", compression=zipfile.ZIP_DEFLATED) as out:
            for info in infos:
                if info.filename == record_name:
                    continue
                data = replace.get(info.filename)
                if data is None:
                    data = archive.read(info)
                copy = zipfile.ZipInfo(info.filename, date_time=info.date_time)
                copy.external_attr, copy.compress_type = info.external_attr, zipfile.ZIP_DEFLATED
                out.writestr(copy, data)
            out.writestr(zipfile.ZipInfo(record_name, date_time=infos[0].date_time), record.getvalue(), zipfile.ZIP_DEFLATED)
    partial.replace(target)


def trimmed_wheel_name(name: str, sm: int) -> str:
    """The trimmed wheel's file name: the same version (TE checks it equals the others'), with a
    build tag naming the architecture, so that it is never mistaken for NVIDIA's."""
    parse_wheel_filename(name)  # a wheel's name, or packaging's error
    parts = name[:-len(".whl")].split("-")
    return "-".join([parts[0], parts[1], f"1sm{sm}", *parts[-3:]]) + ".whl"


def libraries_with_device_code(archive: zipfile.ZipFile) -> list[str]:
    """The shared objects in the wheel that have a .nv_fatbin section."""
    found = []
    for name in archive.namelist():
        if re.search(r"\.so(\.\d+)*$", name):
            data = archive.read(name)
            if data[:4] == b"\x7fELF" and ".nv_fatbin" in elf_sections(data, name):
                found.append(name)
    return found


def trim_wheel(source: Path, sm: int, out_dir: Path, log=print) -> Path:
    """Trim every library with device code in the wheel ``source`` to ``sm``, verify each against
    the original, and write the re-packed wheel (its RECORD rewritten and checked) to ``out_dir``."""
    check_record(source)
    target = out_dir / trimmed_wheel_name(source.name, sm)
    replace = {}
    with zipfile.ZipFile(source) as archive:
        libraries = libraries_with_device_code(archive)
        if not libraries:
            raise ToolError(f"{source.name} holds no library with device code (.nv_fatbin): nothing to trim")
        for name in libraries:
            original = archive.read(name)
            trimmed, report = trim_library(original, sm, what=name)
            checked = verify_trim(original, trimmed, sm, what=name)
            kinds = ", ".join(f"{n} {k}" for k, n in sorted(report.kinds.items(), key=lambda item: (item[0].startswith("PTX"), item[0])))
            log(f"trimmed {name}: {report.containers} containers, kept {report.kept} images ({kinds}; "
                f"{report.kept_bytes / 2**20:.1f} MiB), dropped {report.dropped} ({report.freed_bytes / 2**20:.1f} MiB zeroed); "
                f"{checked} kept images verified byte for byte against the original"
                + (f"; {report.ptx_only} containers had only PTX for sm_{sm}" if report.ptx_only else ""))
            replace[name] = trimmed
        wheel_name = _dist_info(archive.namelist()) + "/WHEEL"
        wheel = archive.read(wheel_name).decode()
    build = target.name.split("-")[2]
    wheel = re.sub(r"^Build: .*\n", "", wheel, flags=re.M).rstrip("\n") + f"\nBuild: {build}\n"
    replace[wheel_name] = wheel.encode()
    out_dir.mkdir(parents=True, exist_ok=True)
    rewrite_wheel(source, target, replace)
    check_record(target)
    verify_wheels(source, target, sm)
    return target


def verify_wheels(original: Path, trimmed: Path, sm: int) -> int:
    """The trimmed wheel holds the original's files, the libraries with device code trimmed to
    ``sm`` (:func:`verify_trim`), every other file identical; its RECORD holds."""
    check_record(trimmed)
    checked = 0
    with zipfile.ZipFile(original) as old, zipfile.ZipFile(trimmed) as new:
        if set(old.namelist()) != set(new.namelist()):
            differ = sorted(set(old.namelist()) ^ set(new.namelist()))[:5]
            raise ToolError(f"{trimmed.name}: its files differ from {original.name}'s: {differ}")
        libraries = set(libraries_with_device_code(old))
        for name in old.namelist():
            if name in libraries:
                checked += verify_trim(old.read(name), new.read(name), sm, what=name)
            elif not name.endswith(("/RECORD", "/WHEEL")) and old.read(name) != new.read(name):
                raise ToolError(f"{trimmed.name}: {name} differs from the original")
    return checked


# ===================================================================== the node and its packages
@dataclass(frozen=True)
class TorchBuild:
    version: str
    """As torch reports it, e.g. 2.11.0+cu130."""

    @property
    def public(self) -> str:
        return self.version.split("+")[0]

    @property
    def cuda(self) -> tuple[int, int]:
        match = re.fullmatch(r"cu(\d+)(\d)", self.version.partition("+")[2])
        if not match:
            raise UsageError(f"torch {self.version}: no CUDA build label (+cuXYZ): give the node's torch as it reports itself, "
                             f"e.g. --torch 2.11.0+cu130 (a vendor build such as NGC's cannot be re-installed from an index)")
        return int(match[1]), int(match[2])


def parse_torch(text: str) -> TorchBuild:
    try:
        Version(text)
    except InvalidVersion:
        raise UsageError(f"--torch {text!r} is not a version: give torch.__version__ from the node, e.g. 2.11.0+cu130") from None
    build = TorchBuild(text)
    major, _ = build.cuda
    if major != 13:
        raise UsageError(f"--torch {text}: CUDA {major}: this tool builds for CUDA 13 (transformer-engine-cu13 and NVIDIA's -cu13 "
                         f"header wheels); a CUDA {major} node needs transformer-engine-cu{major}, which it does not handle")
    return build


def parse_arch(text: str) -> int:
    match = re.fullmatch(r"(?:sm_?)?(\d)\.?(\d+)a?", text.strip().lower())
    if not match:
        raise UsageError(f"--arch {text!r}: give the GPU architecture as sm_90 (H100/H200), sm_80 (A100), ... or 9.0")
    return int(match[1] + match[2])


@dataclass
class Node:
    """What is known of the node: its torch, GPU architecture, Python and (if listed) packages."""

    torch: TorchBuild
    sm: int
    python: str = "3.12"
    packages: Optional[dict[str, Version]] = None
    """{canonical name: version} from --node; None when not listed."""


def read_node(path: Path) -> Node:
    """A node.txt written by the one-line command of the module docstring."""
    try:
        lines = path.read_text().splitlines()
    except OSError as error:
        raise UsageError(f"--node {path}: {error.strerror}: give the file the node's one-line command wrote") from None
    head = [line for line in lines if line.startswith("node: ")]
    match = re.fullmatch(r"node: python (\S+) torch (\S+) arch (sm_\d+)", head[0].strip()) if len(head) == 1 else None
    if not match:
        raise UsageError(f"--node {path}: no 'node: python X torch Y arch sm_Z' line: write it with the command in "
                         f"tools/te_wheels.py --help, on the node")
    packages = {}
    for line in lines:
        if "==" in line and not line.startswith(("node: ", "#")):
            name, _, version = line.strip().partition("==")
            try:
                packages[canonicalize_name(name)] = Version(version)
            except InvalidVersion:
                continue  # a distribution with a non-PEP 440 version: not one a requirement here can name
    return Node(parse_torch(match[2]), parse_arch(match[3]), ".".join(match[1].split(".")[:2]), packages)


# The node's platform for markers (as tools/gpu_wheels.sh evaluates them).
def node_markers(python: str) -> dict:
    return {"implementation_name": "cpython", "implementation_version": f"{python}.0", "os_name": "posix",
            "platform_machine": "x86_64", "platform_python_implementation": "CPython", "platform_release": "",
            "platform_system": "Linux", "platform_version": "", "python_full_version": f"{python}.0", "python_version": python,
            "sys_platform": "linux"}


NODE_OWNED = ("torch", "triton")
"""Never gathered: the node's torch and its compiler (with ``nvidia-*`` and ``cuda-*``, the CUDA
libraries that come with a CUDA torch)."""
NOT_AT_RUN_TIME = {
    "nvidia-cudnn-frontend": "transformer-engine-torch's build needs its headers; at run time TE imports it only in its "
                             "sm_100 fused kernels (grouped MLP, MLA) and checks its version with a fallback when absent; "
                             "11 MiB, plus nvidia-cutlass-dsl",
}
"""Requirements not gathered, with the reason (the MANIFEST repeats it)."""


def node_owned(name: str) -> bool:
    return name in NODE_OWNED or name.startswith(("nvidia-", "cuda-"))


def floor(specifier: SpecifierSet) -> Optional[Version]:
    """The lowest version a specifier admits, where it is given by >=, == or ~= (else None)."""
    floors = [Version(s.version.rstrip(".*")) for s in specifier if s.operator in (">=", "==", "~=", "===")]
    return max(floors) if floors else None


@dataclass
class NodeModel:
    """Which requirement the node meets, as far as this machine can know."""

    node: Node
    torch_requires: dict[str, SpecifierSet]
    """{canonical name: specifier} of the node's torch's own requirements (its wheel's METADATA)."""

    def has(self, req: Requirement) -> Optional[str]:
        """Why the node meets ``req`` (a short reason), or None when it must be gathered."""
        name = canonicalize_name(req.name)
        if name in NOT_AT_RUN_TIME:
            return "not needed at run time"
        if node_owned(name):
            return "the node's torch and CUDA libraries"
        if self.node.packages is not None:
            have = self.node.packages.get(name)
            if have is not None and req.specifier.contains(have, prereleases=True):
                return f"the node has {have}"
            return None
        guaranteed = self.torch_requires.get(name)
        if guaranteed is not None:
            if not req.specifier:
                return f"torch {self.node.torch.version} requires {name}"
            low = floor(guaranteed)
            only_floors = all(s.operator in (">=", ">") for s in req.specifier)
            if low is not None and only_floors and req.specifier.contains(low, prereleases=True):
                return f"torch {self.node.torch.version} requires {name}{guaranteed}"
        return None

    def constrained(self, req: Requirement) -> Requirement:
        """``req`` narrowed to what the node's torch also allows (its own requirement on that name):
        a wheel gathered beside torch must not break it (tensorboard's setuptools>=41 next to
        torch's setuptools<82)."""
        name = canonicalize_name(req.name)
        if name not in self.torch_requires:
            return req
        narrowed = Requirement(str(req))
        narrowed.specifier = req.specifier & self.torch_requires[name]
        return narrowed


def wheel_metadata(path: Path) -> email.message.Message:
    with zipfile.ZipFile(path) as archive:
        meta = next((n for n in archive.namelist() if re.fullmatch(r"[^/]+\.dist-info/METADATA", n)), None)
        if meta is None:
            raise ToolError(f"{path.name} has no .dist-info/METADATA: not a wheel")
        return email.parser.Parser().parsestr(archive.read(meta).decode())


def wheel_requires(path: Path, extras: Iterable[str], markers: dict) -> list[Requirement]:
    """The wheel's requirements that apply on the node (with the requested extras)."""
    result = []
    for line in wheel_metadata(path).get_all("Requires-Dist") or []:
        req = Requirement(line)
        if req.marker is None or any(req.marker.evaluate({**markers, "extra": extra}) for extra in {"", *extras}):
            req.marker = None
            result.append(req)
    return result


def wheels_in(folder: Path) -> dict[str, list[tuple[Version, Path]]]:
    found = {}
    for path in folder.glob("*.whl"):
        name, version, _, _ = parse_wheel_filename(path.name)
        found.setdefault(name, []).append((version, path))
    return found


@dataclass
class Gathered:
    chosen: dict[str, tuple[Version, Path]]
    """{canonical name: (version, wheel)} of every wheel the folder holds for the node."""
    skipped: dict[str, str]
    """{requirement: why it is not gathered}."""


Download = Callable[[list[Requirement]], None]
"""Fetches wheels for these requirements into the folder (pip download --no-deps for the node)."""


def gather(folder: Path, top_level: list[Requirement], model: NodeModel, download: Download) -> Gathered:
    """The closure of ``top_level`` over the wheels' own requirements, for the node, less what the
    node has; downloads what the folder lacks (in rounds, one per level of the tree) and picks, for
    each name, the newest wheel that fits."""
    markers = node_markers(model.node.python)
    chosen, extras, skipped, seen = {}, {}, {}, set()
    queue = []
    for req in top_level:
        why = model.has(req)
        if why:
            skipped[str(req)] = why
        else:
            queue.append((model.constrained(req), "the top-level requirements"))
    while queue:
        have = wheels_in(folder)
        missing = [r for r, _ in queue if canonicalize_name(r.name) not in chosen
                   and not any(r.specifier.contains(v, prereleases=True) for v, _ in have.get(canonicalize_name(r.name), []))]
        if missing:
            download(missing)
            have = wheels_in(folder)
        walk = []
        for req, parent in queue:
            name = canonicalize_name(req.name)
            if name in chosen:
                if not req.specifier.contains(chosen[name][0], prereleases=True):
                    raise ToolError(f"{parent} requires {req}, but {name} {chosen[name][0]} was chosen for another requirement")
                if set(req.extras) - extras[name]:
                    extras[name] |= set(req.extras)
                    walk.append(name)
                continue
            fits = sorted((v, p) for v, p in have.get(name, []) if req.specifier.contains(v, prereleases=True))
            if not fits:
                raise ToolError(f"no wheel of {req} (for {parent}) for the node (Linux x86-64, CPython {model.node.python}) "
                                f"after the download")
            chosen[name], extras[name] = fits[-1], set(req.extras)
            walk.append(name)
        queue = []
        for name in dict.fromkeys(walk):
            parent = f"{name} {chosen[name][0]}"
            for dep in wheel_requires(chosen[name][1], extras[name], markers):
                why = model.has(dep)
                if why:
                    skipped.setdefault(str(dep), why)
                elif (str(dep), tuple(sorted(dep.extras))) not in seen:
                    seen.add((str(dep), tuple(sorted(dep.extras))))
                    queue.append((model.constrained(dep), parent))
    return Gathered(chosen, skipped)


def manifest(folder: Path, gathered: Gathered, header: list[str], max_mib: float) -> tuple[list[str], int]:
    """The MANIFEST.txt lines (header, a line per wheel with size and sha256, the total) and the total."""
    rows, total = [], 0
    for name in sorted(gathered.chosen):
        path = gathered.chosen[name][1]
        size = path.stat().st_size
        total += size
        rows.append(f"{path.name}  {size / 2**20:.2f} MiB  ({size} bytes)  sha256={hashlib.sha256(path.read_bytes()).hexdigest()}")
    skipped = [f"#   {req}: {why}" for req, why in sorted(gathered.skipped.items())]
    lines = [*header, "# not gathered (what the node has, or does not need):", *skipped, *rows,
             f"total: {len(rows)} wheels, {total / 2**20:.1f} MiB (limit {max_mib:g} MiB)"]
    return lines, total


def check_size(gathered: Gathered, total: int, max_mib: float) -> None:
    if total <= max_mib * 2**20:
        return
    largest = sorted(((p.stat().st_size, p.name) for _, p in gathered.chosen.values()), reverse=True)[:4]
    names = ", ".join(f"{name} ({size / 2**20:.1f} MiB)" for size, name in largest)
    raise ToolError(f"the wheels come to {total / 2**20:.1f} MiB, over --max-mib {max_mib:g} (MAX_MIB); the largest: {names}. "
                    f"Give the node's package list (--node node.txt) so that what it has is not gathered, or raise --max-mib")


def remove_unneeded(folder: Path, gathered: Gathered, log=print) -> None:
    keep = {p for _, p in gathered.chosen.values()}
    for path in folder.glob("*.whl"):
        if path not in keep:
            log(f"removing {path.name} (not needed)")
            path.unlink()


# ===================================================================== the build
PLATFORMS = ("manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_26_x86_64 manylinux_2_25_x86_64 manylinux_2_24_x86_64 "
             "manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_12_x86_64 manylinux2010_x86_64 manylinux_2_5_x86_64 "
             "manylinux1_x86_64 linux_x86_64").split()


def run(command: list, log=print, **kwargs) -> None:
    log("+ " + " ".join(map(str, command)))
    proc = subprocess.run(list(map(str, command)), **kwargs)
    if proc.returncode != 0:
        raise ToolError(f"{Path(str(command[0])).name} {' '.join(map(str, command[1:4]))} ... failed (exit {proc.returncode}; "
                        f"its output is above)")


def check_requirements() -> list[Requirement]:
    """What tools/gpu_check.sh imports besides torch (its --requirements)."""
    proc = subprocess.run(["bash", str(REPO / "tools" / "gpu_check.sh"), "--requirements"], capture_output=True, text=True)
    if proc.returncode != 0:
        raise ToolError(f"tools/gpu_check.sh --requirements failed: {proc.stderr.strip()}")
    return [Requirement(line) for line in proc.stdout.split()]


def find_python(version: str, given: Optional[str]) -> str:
    """A python ``version`` (major.minor) for the build venv: --python, else python3.X, python3, this one."""
    candidates = [given] if given else [f"python{version}", "python3", sys.executable]
    env = {**os.environ, "PYENV_VERSION": os.environ.get("PYENV_VERSION", "")}
    for candidate in candidates:
        path = shutil.which(candidate) or candidate
        proc = subprocess.run([path, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"], capture_output=True, text=True, env=env)
        if proc.returncode == 0 and proc.stdout.strip() == version:
            return path
    raise UsageError(f"no Python {version} found ({', '.join(candidates)}): the extension must be built with the node's Python; "
                     f"set --python /path/to/python{version}")


def torch_requires(python: Path) -> dict[str, SpecifierSet]:
    proc = subprocess.run([str(python), "-c", "from importlib import metadata; print('\\n'.join(metadata.requires('torch') or []))"],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise ToolError(f"reading torch's requirements with {python} failed: {proc.stderr.strip()[-500:]}")
    result = {}
    for line in proc.stdout.splitlines():
        req = Requirement(line)
        if req.marker is None or req.marker.evaluate({**node_markers("3.12"), "extra": ""}):
            result[canonicalize_name(req.name)] = req.specifier
    return result


@dataclass
class BuildPlan:
    """Everything ``build`` needs, resolved from the arguments."""

    folder: Path
    node: Node
    te_version: str
    work: Path
    jobs: int
    max_mib: float
    torch_index: Optional[str]
    python: Optional[str]

    @property
    def venv(self) -> Path:
        return self.work / f"venv-py{self.node.python}-torch{self.node.torch.version}"


def build_venv(plan: BuildPlan, log=print) -> Path:
    """The build venv: the node's torch (checked to be exactly the node's build), setuptools, ninja,
    the cuDNN frontend headers and NVIDIA's header wheels that TE's C++ needs (CUDA's crt and cccl,
    for the node's CUDA major.minor). Reused when it is complete."""
    python = plan.venv / "bin" / "python"
    marker = plan.venv / ".complete"
    if marker.exists():
        log(f"build venv: {plan.venv} (reused)")
        return python
    base = find_python(plan.node.python, plan.python)
    run([base, "-m", "venv", "--clear", plan.venv], log)
    pip = [python, "-m", "pip", "install", "--disable-pip-version-check", "-q"]
    torch_spec = f"torch=={plan.node.torch.public}"
    run([*pip, torch_spec, *(["--index-url", plan.torch_index] if plan.torch_index else [])], log)
    proc = subprocess.run([python, "-c", "import torch; print(torch.__version__)"], capture_output=True, text=True)
    if proc.returncode != 0 or proc.stdout.strip() != plan.node.torch.version:
        got = proc.stdout.strip() or proc.stderr.strip()[-300:]
        raise ToolError(f"the index's {torch_spec} is {got}, the node's is {plan.node.torch.version}: the extension must be built "
                        f"against the node's build; give its index, e.g. --torch-index https://download.pytorch.org/whl/"
                        f"{plan.node.torch.version.partition('+')[2]}")
    major, minor = plan.node.torch.cuda
    run([*pip, "setuptools<82", "wheel", "ninja", "packaging"], log)
    # headers only: the cuDNN frontend (its Python side would pull nvidia-cutlass-dsl), CUDA's crt and cccl
    headers = ["nvidia-cudnn-frontend>=1.29.0", f"nvidia-cuda-crt=={major}.{minor}.*", f"nvidia-cuda-cccl=={major}.{minor}.*"]
    run([*pip, "--no-deps", *headers], log)
    marker.write_text(f"{plan.node.torch.version}\n")
    return python


def download_te(plan: BuildPlan, python: Path, downloads: Path, log=print) -> tuple[Path, Path, Path]:
    """The transformer-engine and transformer-engine-cuXX wheels for the node, and the sdist of
    transformer-engine-torch (metadata prepared with the build venv's torch, no isolation)."""
    downloads.mkdir(parents=True, exist_ok=True)
    major, _ = plan.node.torch.cuda
    core = f"transformer-engine-cu{major}"
    pip = [python, "-m", "pip", "download", "--disable-pip-version-check", "--no-deps", "-d", downloads]
    node_wheels = ["--only-binary=:all:", "--python-version", plan.node.python, "--implementation", "cp"]
    for platform in PLATFORMS:
        node_wheels += ["--platform", platform]
    run([*pip, *node_wheels, f"transformer-engine=={plan.te_version}", f"{core}=={plan.te_version}"], log)
    run([*pip, "--no-binary=:all:", "--no-build-isolation", f"transformer-engine-torch=={plan.te_version}"], log)

    def one(pattern: str) -> Path:
        found = sorted(downloads.glob(pattern))
        if len(found) != 1:
            raise ToolError(f"expected one {pattern} in {downloads} after the download, found {[p.name for p in found]}")
        return found[0]

    version = plan.te_version
    return (one(f"transformer_engine-{version}-*.whl"), one(f"{core.replace('-', '_')}-{version}-*.whl"),
            one(f"transformer_engine_torch-{version}.tar.gz"))


def build_extension(plan: BuildPlan, python: Path, sdist: Path, out_dir: Path, log=print) -> Path:
    """transformer-engine-torch built from ``sdist`` in a fresh extract (setup.py deletes its
    build_tools/ and common_headers/ when it finishes); an earlier build of the same sdist against
    the same torch is reused."""
    dist = plan.work / "dist"
    stamp = f"{hashlib.sha256(sdist.read_bytes()).hexdigest()} torch {plan.node.torch.version} sm_{plan.node.sm}\n"
    built = sorted(dist.glob("transformer_engine_torch-*.whl"))
    if len(built) == 1 and (dist / "BUILT").is_file() and (dist / "BUILT").read_text() == stamp:
        log(f"transformer-engine-torch: {built[0].name}, built before from {sdist.name} against torch {plan.node.torch.version} (reused)")
        target = out_dir / built[0].name
        shutil.copy2(built[0], target)
        return target
    src_root = plan.work / "src"
    shutil.rmtree(src_root, ignore_errors=True)
    src_root.mkdir(parents=True)
    with tarfile.open(sdist) as archive:
        archive.extractall(src_root, filter="data")
    (source,) = [p for p in src_root.iterdir() if p.is_dir()]
    env = {**os.environ, "NVTE_PYTORCH_FORCE_BUILD": "TRUE",  # never download a prebuilt wheel
           "NVTE_BUILD_USE_NVIDIA_WHEELS": "1", "NVTE_CUDA_ARCHS": str(plan.node.sm),
           "NVTE_WITH_NCCL_EP": "0",  # the sdist has no nccl_ep.h on its include path
           "NVTE_FRAMEWORK": "pytorch", "MAX_JOBS": str(plan.jobs)}
    shutil.rmtree(dist, ignore_errors=True)
    shown = [key for key in env if key.startswith("NVTE_")] + ["MAX_JOBS"]
    log(f"+ (in {source}) " + " ".join(f"{k}={env[k]}" for k in shown))
    run([python, "setup.py", "-q", "bdist_wheel", "--dist-dir", dist], log, cwd=source, env=env)
    (wheel,) = dist.glob("transformer_engine_torch-*.whl")
    requires = [Requirement(r) for r in wheel_metadata(wheel).get_all("Requires-Dist") or []]
    core = f"transformer-engine-cu{plan.node.torch.cuda[0]}"
    if not any(canonicalize_name(r.name) == core and r.specifier == SpecifierSet(f"=={plan.te_version}") for r in requires):
        raise ToolError(f"{wheel.name} does not require {core}=={plan.te_version} (it requires {', '.join(map(str, requires))}): "
                        f"was it built against another torch's CUDA?")
    (dist / "BUILT").write_text(stamp)
    target = out_dir / wheel.name
    shutil.copy2(wheel, target)
    return target


def pip_downloader(python: Path, folder: Path, node_python: str, log=print) -> Download:
    def download(requirements: list[Requirement]) -> None:
        command = [python, "-m", "pip", "download", "--disable-pip-version-check", "--no-deps", "--only-binary=:all:",
                   "--python-version", node_python, "--implementation", "cp"]
        for platform in PLATFORMS:
            command += ["--platform", platform]
        run([*command, "-d", folder, *map(str, requirements)], log)
    return download


def build(plan: BuildPlan, log=print) -> int:
    started = time.monotonic()
    steps = {}

    def step(name: str, since: float) -> float:
        now = time.monotonic()
        steps[name] = now - since
        return now

    folder = plan.folder
    if folder.exists() and not folder.is_dir():
        raise UsageError(f"{folder} exists and is not a folder: choose another DIR")
    if folder.is_dir() and any(folder.iterdir()) and not (folder / "MANIFEST.txt").exists():
        raise UsageError(f"{folder} is not empty and was not made by te_wheels.py (no MANIFEST.txt): choose a new or empty DIR")
    folder.mkdir(parents=True, exist_ok=True)
    python = build_venv(plan, log)
    meta, core, sdist = download_te(plan, python, plan.work / "downloads", log)
    at = step("build venv and downloads", started)
    extension = build_extension(plan, python, sdist, folder, log)
    at = step("extension", at)
    for old in folder.glob(f"{core.name.split('-')[0]}-*.whl"):
        old.unlink()
    trimmed = trim_wheel(core, plan.node.sm, folder, log)
    shutil.copy2(meta, folder / meta.name)
    at = step("trim and verification", at)
    model = NodeModel(plan.node, torch_requires(python))
    pin = f"=={plan.te_version}"
    top_level = [Requirement(f"transformer-engine[pytorch]{pin}"), Requirement(f"transformer-engine-torch{pin}"),
                 Requirement(f"{canonicalize_name(parse_wheel_filename(trimmed.name)[0])}{pin}"), *check_requirements()]
    gathered = gather(folder, top_level, model, pip_downloader(python, folder, plan.node.python, log))
    remove_unneeded(folder, gathered, log)
    node = plan.node
    header = [f"# tools/te_wheels.py, {datetime.date.today().isoformat()}: Transformer Engine and what tools/gpu_check.sh needs with it, "
              f"for an offline GPU node",
              f"# target: python={node.python} torch={node.torch.version} arch=sm_{node.sm} transformer-engine={plan.te_version}",
              f"# {trimmed.name}: device code trimmed to sm_{node.sm} and verified against {core.name}",
              f"# {extension.name}: built from {sdist.name} against torch {node.torch.version}",
              "# node packages: " + ("listed (--node)" if node.packages is not None else
                                     "not listed: everything but torch and what torch guarantees is here")]
    lines, total = manifest(folder, gathered, header, plan.max_mib)
    (folder / "MANIFEST.txt").write_text("\n".join(lines) + "\n")
    log("\n".join(line for line in lines if not line.startswith("#")))
    step("gathering", at)
    log("time: " + ", ".join(f"{name} {seconds:.0f} s" for name, seconds in steps.items())
        + f"; {(time.monotonic() - started) / 60:.1f} min in all")
    check_size(gathered, total, plan.max_mib)
    log(f"wrote {folder}. Copy it beside the checkout on the GPU node (as ../te_wheels) and run there:\n"
        f"  cd epas-megatron && tools/gpu_check.sh")
    return 0


# ===================================================================== command line
def _inside_repo(path: Path) -> bool:
    try:
        path.resolve().relative_to(REPO)
    except ValueError:
        return False
    return True


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="tools/te_wheels.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=f"The node's one-line command (writes node.txt for --node):\n\n  {NODE_COMMAND}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="{build,trim,verify}")
    b = commands.add_parser("build", help="build, trim and gather the wheel folder for a node")
    b.add_argument("folder", type=Path, metavar="DIR", help="the folder to fill (new, empty, or made by this tool before)")
    b.add_argument("--node", type=Path, help="node.txt from the node's one-line command (python, torch, arch, packages)")
    b.add_argument("--torch", help="the node's torch.__version__, e.g. 2.11.0+cu130 (instead of --node)")
    b.add_argument("--arch", help="the node's GPU architecture, e.g. sm_90 (instead of --node)")
    b.add_argument("--python-version", default="3.12", help="the node's Python major.minor without --node (default 3.12)")
    b.add_argument("--te-version", default=TE_VERSION, help=f"Transformer Engine version (default {TE_VERSION}; see the pin above)")
    b.add_argument("--max-mib", type=float, help=f"size limit of the folder in MiB (default: MAX_MIB, else {MAX_MIB})")
    b.add_argument("--work", type=Path, default=Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "epas-te-build",
                   help="build venv, downloads and sources, outside the checkout (default ~/.cache/epas-te-build; about 5 GB)")
    b.add_argument("--jobs", type=int, default=os.cpu_count() or 2, help="parallel compile jobs (MAX_JOBS; ~2.7 GB of memory each)")
    b.add_argument("--torch-index", help="index to install the node's torch from, where PyPI's build differs")
    b.add_argument("--python", help="the Python to make the build venv with (default: python3.X, python3 or this one)")
    t = commands.add_parser("trim", help="trim a core wheel's device code to one architecture")
    t.add_argument("wheel", type=Path)
    t.add_argument("--arch", required=True, help="e.g. sm_90")
    t.add_argument("--out", type=Path, required=True, help="folder for the trimmed wheel")
    v = commands.add_parser("verify", help="check a trimmed wheel or library against its original")
    v.add_argument("original", type=Path)
    v.add_argument("trimmed", type=Path)
    v.add_argument("--arch", required=True, help="e.g. sm_90")
    sys.stdout.reconfigure(line_buffering=True)  # in order with the output of the commands it runs
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:
        return int(exit_.code or 0)
    try:
        if args.command == "trim":
            if not args.wheel.is_file():
                raise UsageError(f"{args.wheel}: no such wheel")
            target = trim_wheel(args.wheel, parse_arch(args.arch), args.out)
            print(f"wrote {target} ({target.stat().st_size / 2**20:.1f} MiB; RECORD checked)")
            return 0
        if args.command == "verify":
            sm = parse_arch(args.arch)
            for path in (args.original, args.trimmed):
                if not path.is_file():
                    raise UsageError(f"{path}: no such file")
            if args.original.suffix == ".whl":
                checked = verify_wheels(args.original, args.trimmed, sm)
            else:
                checked = verify_trim(args.original.read_bytes(), args.trimmed.read_bytes(), sm, what=str(args.trimmed))
            print(f"verified: {checked} kept images byte-identical to the original's; nothing else changed")
            return 0
        return build(resolve(args))
    except UsageError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except ToolError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1


def resolve(args) -> BuildPlan:
    """The build's plan from its arguments (UsageError naming the flag when they do not fit)."""
    if args.node is not None:
        if args.torch or args.arch:
            raise UsageError("--node gives the torch and the architecture: leave out --torch and --arch, or --node")
        node = read_node(args.node)
    elif args.torch and args.arch:
        node = Node(parse_torch(args.torch), parse_arch(args.arch), args.python_version)
    else:
        raise UsageError("give the node: --node node.txt (its one-line command is in --help), or --torch VERSION and --arch sm_XX")
    if args.max_mib is None:
        try:
            args.max_mib = float(os.environ.get("MAX_MIB", MAX_MIB))
        except ValueError:
            raise UsageError(f"MAX_MIB={os.environ['MAX_MIB']} is not a number of MiB") from None
    if args.max_mib <= 0:
        raise UsageError(f"--max-mib {args.max_mib:g} (MAX_MIB): give a positive size in MiB")
    if args.jobs < 1:
        raise UsageError(f"--jobs {args.jobs}: give at least 1")
    if _inside_repo(args.work):
        raise UsageError(f"--work {args.work} is inside the checkout: the build venv (5 GB, with TE's build tools) belongs outside it")
    return BuildPlan(args.folder, node, args.te_version, args.work.resolve(), args.jobs, args.max_mib, args.torch_index, args.python)


if __name__ == "__main__":
    sys.exit(main())
