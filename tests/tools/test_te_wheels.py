"""tools/te_wheels.py (Transformer Engine for an offline GPU node) and tools/gpu_check.sh with a TE
wheelhouse, on this CPU machine: the fat-binary trim of a small ELF shared object built here by hand
(containers of cubins and PTX for several SMs) against the result assembled here independently, its
refusals, the verification catching planted differences, the wheel round trip (RECORD with the new
hashes, installable by pip), the gathering over fake wheels (what the node has, what torch
guarantees, markers and extras, the size limit), the node's one-line command, the build's argument
checks, and gpu_check.sh's TE plan and its one-line stop for a TE that does not load. The full build
(minutes, gigabytes) is a documented command (docs/gpu.md), not a test."""

from __future__ import annotations

import base64
import csv
import hashlib
import importlib.metadata
import importlib.util
import io
import os
import re
import shutil
import struct
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

from epas_testing import REPO

TOOL = REPO / "tools" / "te_wheels.py"
GPU_CHECK = REPO / "tools" / "gpu_check.sh"
spec = importlib.util.spec_from_file_location("epas_te_wheels", TOOL)
te_wheels = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = te_wheels
spec.loader.exec_module(te_wheels)


# ------------------------------------------------------------------------- a shared object, by hand
def elf(sections: list[tuple[str, bytes]]) -> tuple[bytes, dict[str, int]]:
    """An ELF64 little-endian shared object: the 64-byte header, each section's bytes at a 16-byte
    boundary, .shstrtab, then the section header table (null section first). Returns the bytes and
    each section's file offset."""
    table = sections + [(".shstrtab", None)]
    names, name_at = b"\0", {}
    for name, _ in table:
        name_at[name] = len(names)
        names += name.encode() + b"\0"
    body, offsets = bytearray(64), {}
    for name, data in sections + [(".shstrtab", names)]:
        body += bytes(-len(body) % 16)
        offsets[name] = len(body)
        body += data
    body += bytes(-len(body) % 8)
    shoff = len(body)
    headers = [bytes(64)]
    for name, data in sections + [(".shstrtab", names)]:
        sh_type = 3 if name == ".shstrtab" else 1  # SHT_STRTAB, SHT_PROGBITS
        headers.append(struct.pack("<IIQQQQIIQQ", name_at[name], sh_type, 0, 0, offsets[name], len(data), 0, 0, 16, 0))
    body += b"".join(headers)
    ident = b"\x7fELF" + bytes([2, 1, 1, 0]) + bytes(8)  # ELFCLASS64, little-endian, version 1
    body[:64] = ident + struct.pack("<HHIQQQIHHHHHH", 3, 62, 1, 0, 0, shoff, 0, 64, 0, 0, 64, len(headers), len(headers) - 1)
    return bytes(body), offsets


PTX, CUBIN = 1, 2


def image(kind: int, sm: int, payload: int, seed: int, header_size: int = 64) -> bytes:
    """A fat-binary entry: its header (kind, version, header size, padded payload size, ..., the SM
    at byte 28; 64, 112 or 120 bytes in TE's core library) and a payload of non-zero bytes padded to 16."""
    data = bytes((seed * 37 + i * 11) % 251 + 1 for i in range(payload))
    padded = data + bytes(-len(data) % 16)
    header = struct.pack("<HHIQIIII", kind, 0x0101, header_size, len(padded), 0, len(data), 0, sm) + bytes(header_size - 32)
    assert len(header) == header_size and struct.unpack_from("<I", header, 28)[0] == sm
    return header + padded


def container(entries: list[bytes], body_size: int | None = None) -> bytes:
    body = b"".join(entries)
    size = len(body) if body_size is None else body_size
    return struct.pack("<IHHQ", 0xBA55ED50, 1, 16, size) + body + bytes(size - len(body))


# Three containers: A has sm_75, sm_90 (two cubins, one PTX), sm_100; B has no sm_90 cubin, only
# its PTX; C has one sm_90 cubin. 16 zero bytes of padding between containers.
A = [image(CUBIN, 75, 40, 1), image(CUBIN, 90, 56, 2), image(PTX, 90, 70, 3), image(CUBIN, 100, 33, 4), image(CUBIN, 90, 24, 5)]
B = [image(CUBIN, 80, 48, 6), image(PTX, 90, 30, 7, header_size=112), image(PTX, 80, 20, 8)]
C = [image(CUBIN, 90, 64, 9, header_size=120), image(CUBIN, 120, 16, 10, header_size=120)]
KEPT_SM90 = [[A[1], A[4]], [B[1]], [C[0]]]
GAP = bytes(16)
TEXT = b"host code that registers each container by its address " * 3
RODATA = b"data after the device code"


def library(containers=(A, B, C), fatbin: bytes | None = None) -> tuple[bytes, dict[str, int]]:
    if fatbin is None:
        fatbin = GAP.join(container(list(c)) for c in containers)
    return elf([(".text", TEXT), (".nv_fatbin", fatbin), (".rodata", RODATA)])


def expected_sm90() -> bytes:
    """The trimmed library, assembled from the entries themselves: each container at its place,
    its sm_90 cubins (B: its sm_90 PTX, having no cubin) first with the body size shrunk, then zeros."""
    original, offsets = library()
    bodies = [(b"".join(kept), b"".join(full)) for kept, full in zip(KEPT_SM90, (A, B, C))]
    fatbin = GAP.join(struct.pack("<IHHQ", 0xBA55ED50, 1, 16, len(kept)) + kept + bytes(len(full) - len(kept)) for kept, full in bodies)
    start = offsets[".nv_fatbin"]
    return original[:start] + fatbin + original[start + len(fatbin):]


def test_trimming_keeps_each_containers_sm90_cubins_in_place_byte_for_byte():
    original, offsets = library()
    trimmed, report = te_wheels.trim_library(original, 90)
    want = expected_sm90()
    assert len(trimmed) == len(original) and trimmed == want
    # outside .nv_fatbin nothing moved; the host code's view (each container's address) is unchanged
    assert trimmed[:offsets[".nv_fatbin"]] == original[:offsets[".nv_fatbin"]]
    assert trimmed.endswith(original[offsets[".rodata"]:])
    assert (report.containers, report.kept, report.dropped, report.ptx_only) == (3, 4, 6, 1)
    assert report.kinds == {"cubin sm_90": 3, "PTX sm_90": 1}
    assert report.kept_bytes == sum(len(e) for kept in KEPT_SM90 for e in kept)
    assert te_wheels.verify_trim(original, trimmed, 90) == 4
    # without B, every container has an sm_90 cubin and no PTX is kept
    assert te_wheels.trim_library(library(containers=(A, C))[0], 90)[1].kinds == {"cubin sm_90": 3}


def test_an_sm_some_container_lacks_is_refused_naming_the_container_and_its_sms():
    original, offsets = library()
    with pytest.raises(te_wheels.ToolError) as error:
        te_wheels.trim_library(original, 100)
    b_offset = offsets[".nv_fatbin"] + len(container(A)) + len(GAP)
    c_offset = b_offset + len(container(B)) + len(GAP)
    message = str(error.value)
    assert "2 of 3 fat-binary containers have no image for sm_100" in message
    assert f"offset {b_offset:#x}: cubin sm_80, PTX sm_80, PTX sm_90" in message
    assert f"offset {c_offset:#x}: cubin sm_90, cubin sm_120" in message and "--arch" in message


@pytest.mark.parametrize("case, message", [
    ("no-fatbin", "has no .nv_fatbin section"),
    ("corrupt-magic", "no fat-binary container at offset {b:#x}: magic 0xba55ed51"),
    ("overrun", "runs past the section's end"),
    ("not-elf", "is not an ELF file"),
], ids=lambda x: x if isinstance(x, str) and " " not in x else None)
def test_what_is_not_a_trimmable_library_is_named(case, message):
    original, offsets = library()
    b = offsets[".nv_fatbin"] + len(container(A)) + len(GAP)
    data = bytearray(original)
    if case == "no-fatbin":
        data = bytearray(elf([(".text", TEXT), (".rodata", RODATA)])[0])
    elif case == "corrupt-magic":
        data[b] ^= 0x01
    elif case == "overrun":
        struct.pack_into("<Q", data, b + 8, 10**6)
    else:
        data[:4] = b"MZ\x90\x00"
    with pytest.raises(te_wheels.ToolError, match=re.escape(message.format(b=b))):
        te_wheels.trim_library(bytes(data), 90)


@pytest.mark.parametrize("where", ["kept-image", "outside", "freed-bytes", "body-size"])
def test_verification_finds_a_planted_difference(where):
    original, offsets = library()
    trimmed = bytearray(expected_sm90())
    start = offsets[".nv_fatbin"]
    if where == "kept-image":  # the last byte of A's second kept cubin (sm_90, seed 5)
        trimmed[start + 16 + len(A[1]) + len(A[4]) - 20] ^= 0xFF
        message = "the cubin sm_90 image at"
    elif where == "outside":
        trimmed[offsets[".text"] + 3] ^= 0xFF
        message = "outside .nv_fatbin, differs"
    elif where == "freed-bytes":
        trimmed[start + 16 + len(A[1]) + len(A[4]) + 5] = 7
        message = "are not zero"
    else:  # A's body size, one image too short: its second cubin is not there
        struct.pack_into("<Q", trimmed, start + 8, len(A[1]))
        message = "holds 1 images, expected 2"
    with pytest.raises(te_wheels.ToolError, match=message):
        te_wheels.verify_trim(original, bytes(trimmed), 90)


# ------------------------------------------------------------------------- the wheel round trip
def record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def make_wheel(path: Path, files: dict[str, bytes], dist_info: str) -> Path:
    """A wheel with ``files`` and a RECORD computed here."""
    rows = [[name, record_hash(data), str(len(data))] for name, data in files.items()] + [[f"{dist_info}/RECORD", "", ""]]
    record = io.StringIO()
    csv.writer(record, lineterminator="\n").writerows(rows)
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, data in files.items():
            archive.writestr(name, data)
        archive.writestr(f"{dist_info}/RECORD", record.getvalue())
    return path


WHEEL_FILE = b"Wheel-Version: 1.0\nGenerator: test_te_wheels\nRoot-Is-Purelib: false\nTag: py3-none-manylinux_2_28_x86_64\n"
CORE_INFO = "transformer_engine_cu13-2.20.2.dist-info"


def core_files(so: bytes) -> dict[str, bytes]:
    return {"transformer_engine/libtransformer_engine.so": so,
            "transformer_engine/libplain.so": elf([(".text", b"no device code here")])[0],
            "transformer_engine/wheel_lib.py": b"# the core's python side\n",
            f"{CORE_INFO}/METADATA": b"Metadata-Version: 2.1\nName: transformer_engine_cu13\nVersion: 2.20.2\n",
            f"{CORE_INFO}/WHEEL": WHEEL_FILE}


def te(*args, timeout=120):
    return subprocess.run([sys.executable, str(TOOL), *map(str, args)], capture_output=True, text=True, timeout=timeout, cwd=REPO)


def test_a_core_wheel_is_trimmed_repacked_with_a_correct_record_and_installs(tmp_path):
    name = "transformer_engine_cu13-2.20.2-py3-none-manylinux_2_28_x86_64.whl"
    original = make_wheel(tmp_path / name, core_files(library()[0]), CORE_INFO)
    proc = te("trim", original, "--arch", "sm_90", "--out", tmp_path / "out")
    assert proc.returncode == 0, proc.stderr
    assert "kept 4 images (3 cubin sm_90, 1 PTX sm_90" in proc.stdout and "4 kept images verified byte for byte" in proc.stdout
    trimmed = tmp_path / "out" / "transformer_engine_cu13-2.20.2-1sm90-py3-none-manylinux_2_28_x86_64.whl"
    assert trimmed.is_file(), list((tmp_path / "out").iterdir())
    want = {**core_files(expected_sm90()), f"{CORE_INFO}/WHEEL": WHEEL_FILE + b"Build: 1sm90\n"}
    with zipfile.ZipFile(trimmed) as archive:
        assert {n: archive.read(n) for n in archive.namelist() if not n.endswith("RECORD")} == want
        rows = {row[0]: row[1:] for row in csv.reader(io.StringIO(archive.read(f"{CORE_INFO}/RECORD").decode())) if row}
    assert rows == {**{name: [record_hash(data), str(len(data))] for name, data in want.items()}, f"{CORE_INFO}/RECORD": ["", ""]}
    # pip takes it (no index, no dependencies), and what it installs is the trimmed library
    target = tmp_path / "site"
    install = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target", target, trimmed],
                             capture_output=True, text=True, timeout=120)
    assert install.returncode == 0, install.stderr
    assert (target / "transformer_engine" / "libtransformer_engine.so").read_bytes() == expected_sm90()
    # the verify command agrees, and finds a cubin changed behind a RECORD that was made to match
    assert te("verify", original, trimmed, "--arch", "sm_90").stdout.startswith("verified: 4 kept images byte-identical")
    bad = bytearray(expected_sm90())
    bad[library()[1][".nv_fatbin"] + 16 + 70] ^= 0x40  # inside A's first kept cubin
    forged = make_wheel(tmp_path / "forged.whl", {**want, "transformer_engine/libtransformer_engine.so": bytes(bad)}, CORE_INFO)
    proc = te("verify", original, forged, "--arch", "sm_90")
    assert proc.returncode == 1 and "error: transformer_engine/libtransformer_engine.so: the cubin sm_90 image at" in proc.stderr


def test_a_wheel_whose_record_lies_is_refused_before_trimming(tmp_path):
    files = core_files(library()[0])
    wheel = make_wheel(tmp_path / "transformer_engine_cu13-2.20.2-py3-none-manylinux_2_28_x86_64.whl", files, CORE_INFO)
    with zipfile.ZipFile(wheel) as archive:
        entries = {n: archive.read(n) for n in archive.namelist()}
    entries["transformer_engine/wheel_lib.py"] = b"# changed after RECORD was written\n"
    with zipfile.ZipFile(wheel, "w") as archive:
        for name, data in entries.items():
            archive.writestr(name, data)
    proc = te("trim", wheel, "--arch", "sm_90", "--out", tmp_path / "out")
    assert proc.returncode == 1 and "transformer_engine/wheel_lib.py does not match its RECORD entry" in proc.stderr
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------- gathering, over fake wheels
def fake_wheel(folder: Path, name: str, version: str, requires=(), build: str = "", size: int = 0) -> Path:
    dist = name.replace("-", "_")
    tag = f"-{build}" if build else ""
    path = folder / f"{dist}-{version}{tag}-py3-none-any.whl"
    meta = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n" + "".join(f"Requires-Dist: {r}\n" for r in requires)
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr(f"{dist}-{version}.dist-info/METADATA", meta)
        archive.writestr(f"{dist}/padding.bin", os.urandom(size))
    return path


TE_META = ['transformer_engine_torch==2.20.2; extra == "pytorch"', 'transformer_engine_cu13==2.20.2; extra == "core_cu13"',
           'transformer_engine_jax==2.20.2; extra == "jax"']
TE_TORCH = ["torch>=2.1", "einops", "onnx", "pydantic", "nvidia-cudnn-frontend>=1.29.0", "transformer_engine_cu13==2.20.2"]


@pytest.fixture
def index(tmp_path):
    """A package index (a folder of fake wheels) shaped like TE 2.20.2's real requirements."""
    folder = tmp_path / "index"
    folder.mkdir()
    for name, version, requires in [
        ("transformer-engine", "2.20.2", TE_META), ("transformer-engine-torch", "2.20.2", TE_TORCH),
        ("transformer-engine-cu13", "2.20.2", []), ("transformer-engine-jax", "2.20.2", []), ("einops", "0.8.2", []),
        ("onnx", "1.23.2", ["numpy>=1.23.2", "protobuf>=6.31.1", "typing_extensions>=4.7.1", "ml_dtypes>=0.5.4",
                            'pywin32; sys_platform == "win32"']),
        ("ml-dtypes", "0.6.0", ["numpy>=2.0.0"]), ("numpy", "2.3.0", []), ("numpy", "1.26.4", []), ("protobuf", "6.33.0", []),
        ("pydantic", "2.14.4", ["annotated-types>=0.6.0", "pydantic-core==2.50.5", "typing-extensions>=4.16.0",
                                "typing-inspection>=0.4.4"]),
        ("pydantic-core", "2.50.5", ["typing-extensions>=4.16.0"]), ("pydantic-core", "2.50.6", []), ("annotated-types", "0.8.0", []),
        ("typing-inspection", "0.4.5", ["typing-extensions>=4.15.0"]), ("typing-extensions", "4.16.0", []),
        ("typing-extensions", "4.9.0", []), ("megatron-core", "0.19.2", ["torch", "numpy<3", "packaging"]), ("packaging", "25.0", []),
        ("pywin32", "311", []), ("nvidia-cudnn-frontend", "1.32.0", []),
    ]:
        fake_wheel(folder, name, version, requires)
    return folder


def fake_pip(index: Path, folder: Path, calls: list):
    """pip download --no-deps: the newest wheel in the index that fits each requirement."""
    def download(requirements):
        calls.append(sorted(str(r) for r in requirements))
        for req in requirements:
            found = [(Version(p.name.split("-")[1]), p) for p in index.glob("*.whl")
                     if canonicalize_name(p.name.split("-")[0]) == canonicalize_name(req.name)]
            fits = sorted((v, p) for v, p in found if req.specifier.contains(v, prereleases=True))
            if fits:
                shutil.copy2(fits[-1][1], folder)
    return download


TORCH_REQUIRES = {"typing-extensions": SpecifierSet(">=4.10.0"), "sympy": SpecifierSet(">=1.13.3"), "filelock": SpecifierSet(""),
                  "setuptools": SpecifierSet("<82")}
TOP = [Requirement("transformer-engine[pytorch]==2.20.2"), Requirement("transformer-engine-torch==2.20.2"),
       Requirement("transformer-engine-cu13==2.20.2"), Requirement("megatron-core>=0.19.2,<0.20"), Requirement("numpy>=1.26")]


def node(packages=None):
    return te_wheels.Node(te_wheels.TorchBuild("2.11.0+cu130"), 90, "3.12", packages)


def test_gathering_takes_the_closure_less_torch_and_what_it_guarantees(tmp_path, index):
    folder = tmp_path / "te_wheels"
    folder.mkdir()
    trimmed = fake_wheel(folder, "transformer-engine-cu13", "2.20.2", build="1sm90")  # made by the trim, before the gathering
    calls = []
    gathered = te_wheels.gather(folder, TOP, te_wheels.NodeModel(node(), TORCH_REQUIRES), fake_pip(index, folder, calls))
    chosen = {name: str(version) for name, (version, _) in gathered.chosen.items()}
    assert chosen == {"transformer-engine": "2.20.2", "transformer-engine-torch": "2.20.2", "transformer-engine-cu13": "2.20.2",
                      "megatron-core": "0.19.2", "numpy": "2.3.0", "packaging": "25.0", "einops": "0.8.2", "onnx": "1.23.2",
                      "pydantic": "2.14.4", "pydantic-core": "2.50.5", "annotated-types": "0.8.0", "typing-inspection": "0.4.5",
                      "typing-extensions": "4.16.0", "protobuf": "6.33.0", "ml-dtypes": "0.6.0"}
    assert gathered.chosen["transformer-engine-cu13"][1] == trimmed  # the trimmed core, never NVIDIA's
    assert not list(folder.glob("transformer_engine_cu13-2.20.2-py3*")) and not list(folder.glob("transformer_engine_jax*"))
    assert not list(folder.glob("pywin32*")) and not list(folder.glob("nvidia_*")) and not list(folder.glob("torch*"))
    # torch's floor (typing-extensions>=4.10.0) covers onnx's >=4.7.1 but not pydantic's >=4.16.0
    assert gathered.skipped["typing_extensions>=4.7.1"] == "torch 2.11.0+cu130 requires typing-extensions>=4.10.0"
    assert gathered.skipped["nvidia-cudnn-frontend>=1.29.0"] == "not needed at run time"
    assert gathered.skipped["torch>=2.1"] == "the node's torch and CUDA libraries"
    assert calls[0] == ["megatron-core<0.20,>=0.19.2", "numpy>=1.26", "transformer-engine-torch==2.20.2",
                        "transformer-engine[pytorch]==2.20.2"]  # the trimmed core is there already
    # the manifest: each wheel, its size and sha256 (computed here), and the total
    lines, total = te_wheels.manifest(folder, gathered, ["# header"], 60)
    assert total == sum(p.stat().st_size for p in folder.glob("*.whl"))
    for path in folder.glob("*.whl"):
        size = path.stat().st_size
        assert f"{path.name}  {size / 2**20:.2f} MiB  ({size} bytes)  sha256={hashlib.sha256(path.read_bytes()).hexdigest()}" in lines
    assert lines[-1] == f"total: 15 wheels, {total / 2**20:.1f} MiB (limit 60 MiB)"


def test_what_the_node_lists_is_not_gathered_unless_too_old(tmp_path, index):
    folder = tmp_path / "te_wheels"
    folder.mkdir()
    fake_wheel(folder, "transformer-engine-cu13", "2.20.2", build="1sm90")
    have = {"numpy": "2.1.0", "protobuf": "6.33.0", "packaging": "24.2", "einops": "0.8.1", "typing-extensions": "4.12.2"}
    model = te_wheels.NodeModel(node({k: Version(v) for k, v in have.items()}), TORCH_REQUIRES)
    gathered = te_wheels.gather(folder, TOP, model, fake_pip(index, folder, []))
    assert not {"numpy", "protobuf", "packaging", "einops"} & set(gathered.chosen)
    assert gathered.skipped["numpy>=2.0.0"] == "the node has 2.1.0"
    # the node's typing-extensions 4.12.2 is too old for pydantic: a newer one is carried
    assert str(gathered.chosen["typing-extensions"][0]) == "4.16.0"


def test_what_torch_requires_bounds_what_is_gathered_beside_it(tmp_path, index):
    """tensorboard's setuptools>=41 beside torch's setuptools<82: not the newest setuptools, which
    would break torch; and a requirement of any version of what torch requires is the node's."""
    folder = tmp_path / "te_wheels"
    folder.mkdir()
    fake_wheel(index, "tensorboard", "2.21.0", ["setuptools>=41.0.0", "filelock", "markdown>=2.6.8"])
    fake_wheel(index, "setuptools", "84.2.1")
    fake_wheel(index, "setuptools", "81.0.0")
    fake_wheel(index, "filelock", "3.20.0")
    fake_wheel(index, "markdown", "3.11.3")
    gathered = te_wheels.gather(folder, [Requirement("tensorboard>=2.16")], te_wheels.NodeModel(node(), TORCH_REQUIRES),
                                fake_pip(index, folder, []))
    assert {name: str(v) for name, (v, _) in gathered.chosen.items()} == {"tensorboard": "2.21.0", "setuptools": "81.0.0",
                                                                         "markdown": "3.11.3"}
    assert gathered.skipped["filelock"] == "torch 2.11.0+cu130 requires filelock"


def test_a_conflict_and_a_missing_wheel_are_named(tmp_path, index):
    folder = tmp_path / "te_wheels"
    folder.mkdir()
    model = te_wheels.NodeModel(node({}), TORCH_REQUIRES)
    conflict = r"pydantic 2\.14\.4 requires pydantic-core==2\.50\.5, but pydantic-core 2\.50\.6 was chosen"
    with pytest.raises(te_wheels.ToolError, match=conflict):
        te_wheels.gather(folder, [Requirement("pydantic-core==2.50.6"), Requirement("pydantic")], model, fake_pip(index, folder, []))
    with pytest.raises(te_wheels.ToolError, match=r"no wheel of flash-attn>=2 \(for the top-level requirements\) for the node"):
        te_wheels.gather(folder, [Requirement("flash-attn>=2")], model, fake_pip(index, folder, []))


def test_the_size_limit_fails_naming_the_largest_wheels(tmp_path):
    folder = tmp_path / "te_wheels"
    folder.mkdir()
    big = fake_wheel(folder, "transformer-engine-cu13", "2.20.2", build="1sm90", size=900_000)
    small = fake_wheel(folder, "einops", "0.8.2", size=100_000)
    gathered = te_wheels.Gathered({"transformer-engine-cu13": (Version("2.20.2"), big), "einops": (Version("0.8.2"), small)}, {})
    lines, total = te_wheels.manifest(folder, gathered, [], 0.5)
    te_wheels.check_size(gathered, total, 1)  # within 1 MiB
    with pytest.raises(te_wheels.ToolError) as error:
        te_wheels.check_size(gathered, total, 0.5)
    message = str(error.value)
    assert f"{total / 2**20:.1f} MiB, over --max-mib 0.5 (MAX_MIB)" in message and "--node node.txt" in message
    assert message.index(big.name) < message.index(small.name)  # largest first


# ------------------------------------------------------------------------- the node's one-line command
CAPABILITY_90 = "import torch.cuda\ntorch.cuda.get_device_capability = lambda *args, **kwargs: (9, 0)\n"


def test_the_nodes_one_line_command_writes_what_build_reads(tmp_path):
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "python3").write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')  # this venv's python, as the node's
    (tmp_path / "bin" / "python3").chmod(0o755)
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(CAPABILITY_90)
    env = {**os.environ, "PATH": f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}", "PYTHONPATH": str(tmp_path / "site")}
    proc = subprocess.run(["bash", "-c", te_wheels.NODE_COMMAND], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    read = te_wheels.read_node(tmp_path / "node.txt")
    assert (read.torch.version, read.sm, read.python) == (torch.__version__, 90, f"{sys.version_info[0]}.{sys.version_info[1]}")
    assert read.packages["torch"] == Version(importlib.metadata.version("torch"))
    assert read.packages["packaging"] == Version(__import__("packaging").__version__)
    # the guide quotes the very command
    assert te_wheels.NODE_COMMAND in (REPO / "docs" / "gpu.md").read_text()


# ------------------------------------------------------------------------- the build's arguments
@pytest.mark.parametrize("args, message", [
    ([], "give the node: --node node.txt"),
    (["--torch", "2.11.0", "--arch", "sm_90"], "no CUDA build label (+cuXYZ)"),
    (["--torch", "2.11.0+cu128", "--arch", "sm_90"], "CUDA 12: this tool builds for CUDA 13"),
    (["--torch", "2.11.0+cu130", "--arch", "hopper"], "--arch 'hopper'"),
    (["--torch", "2.11.0+cu130", "--arch", "sm_90", "--max-mib", "0"], "--max-mib 0 (MAX_MIB)"),
    (["--torch", "2.11.0+cu130", "--arch", "sm_90", "--work", str(REPO / "te-build")], "is inside the checkout"),
    (["--node", "/nonexistent/node.txt"], "--node /nonexistent/node.txt: No such file"),
    (["--node", "{garbled}"], "no 'node: python X torch Y arch sm_Z' line"),
    (["--node", "{garbled}", "--arch", "sm_90"], "leave out --torch and --arch, or --node"),
], ids=["no-node", "no-cuda-label", "cuda-12", "bad-arch", "max-mib", "work-in-repo", "node-missing", "node-garbled", "node-and-arch"])
def test_bad_build_arguments_exit_2_naming_the_flag(tmp_path, capsys, args, message):
    garbled = tmp_path / "node.txt"
    garbled.write_text("torch 2.11.0\nnumpy==2.1.0\n")
    args = [str(garbled) if a == "{garbled}" else a for a in args]
    assert te_wheels.main(["build", str(tmp_path / "te_wheels"), *args]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "te_wheels").exists()


def test_a_foreign_folder_is_not_filled(tmp_path, capsys):
    (tmp_path / "mine.txt").write_text("keep me")
    assert te_wheels.main(["build", str(tmp_path), "--torch", "2.11.0+cu130", "--arch", "sm_90", "--work", str(tmp_path / "w")]) == 2
    assert "was not made by te_wheels.py (no MANIFEST.txt)" in capsys.readouterr().err and not (tmp_path / "w").exists()


def test_help_names_the_pin_the_exit_statuses_and_the_nodes_command():
    proc = te("--help")
    assert proc.returncode == 0 and "Exit status: 0" in proc.stdout and te_wheels.NODE_COMMAND in proc.stdout
    assert f"The pin, TE {te_wheels.TE_VERSION}" in proc.stdout


# ------------------------------------------------------------------------- gpu_check.sh with a TE wheelhouse
FAKE_GPU_90 = """\
import importlib.abc, importlib.machinery, sys


class _TorchWithAnH100(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "torch":
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            module.cuda.is_available = lambda: True
            module.cuda.device_count = lambda: 1
            module.cuda.get_device_name = lambda *args, **kwargs: "NVIDIA H100 80GB HBM3"
            module.cuda.get_device_capability = lambda *args, **kwargs: (9, 0)

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _TorchWithAnH100())
"""


def dist_info(site: Path, name: str, version: str, requires=()):
    folder = site / f"{name.replace('-', '_')}-{version}.dist-info"
    folder.mkdir(parents=True)
    (folder / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
                                     + "".join(f"Requires-Dist: {r}\n" for r in requires))


@pytest.fixture
def te_node(tmp_path):
    """gpu_check.sh on this venv's python as an H100 node's (sm_90), a TE wheelhouse built for this
    torch and sm_90 (its MANIFEST only: what the node needs of it is planted as installed), and a
    planted transformer_engine whose import fails as it does where cuDNN is not on the library path."""
    fake = tmp_path / "fake"
    fake.mkdir()
    (fake / "sitecustomize.py").write_text(FAKE_GPU_90)
    dist_info(fake, "pytest-timeout", "2.3.1")
    dist_info(fake, "transformer-engine", "2.20.2", ['transformer_engine_torch==2.20.2; extra == "pytorch"'])
    dist_info(fake, "transformer-engine-torch", "2.20.2")
    (fake / "transformer_engine").mkdir()
    (fake / "transformer_engine" / "__init__.py").write_text(
        'raise OSError("libcudnn.so.9: cannot open shared object file: No such file or directory")\n')
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "nvidia-smi").write_text('#!/bin/sh\necho "NVIDIA H100 80GB HBM3, 570.86.15"\n')
    (tmp_path / "bin" / "nvidia-smi").chmod(0o755)
    wheels = tmp_path / "te_wheels"
    wheels.mkdir()
    (wheels / "MANIFEST.txt").write_text(f"# tools/te_wheels.py\n# target: python=3.12 torch={torch.__version__} arch=sm_90 "
                                         f"transformer-engine=2.20.2\n")
    env = {**{k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}, "OMP_NUM_THREADS": "1",
           "PATH": f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}", "PYTHONPATH": str(fake), "PYTHON": sys.executable,
           "VENV": str(tmp_path / "venv"), "OUT": str(tmp_path / "out"), "WHEELS": str(wheels)}
    return env, wheels


def check(env, *args, timeout=300):
    return subprocess.run(["bash", str(GPU_CHECK), *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def test_a_te_that_does_not_load_stops_the_check_in_one_line_with_no_fallback(te_node, tmp_path):
    env, wheels = te_node
    proc = check(env)
    assert proc.returncode == 2, (proc.stdout[-3000:], proc.stderr[-3000:])
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert errors[0].startswith("error: Transformer Engine does not load (import transformer_engine.pytorch): the library "
                                "libcudnn.so.9 is not on the library path (OSError: libcudnn.so.9: cannot open shared object file")
    assert "no fall-back to local layers" in errors[0] and f"[traceback: {tmp_path / 'out'}/te_load.log]" in errors[0]
    assert "OSError: libcudnn.so.9" in (tmp_path / "out" / "te_load.log").read_text()
    # TE was asked for, by the plan, and pointed at this python's cuDNN and NVIDIA libraries
    site = Path(torch.__file__).parent.parent
    assert f"Transformer Engine: 2.20.2 from {wheels}" in proc.stdout
    assert f"+ export CUDNN_PATH={site}/nvidia/cudnn" in proc.stdout and f"+ export NVRTC_PATH={site}/nvidia/cu13" in proc.stdout
    assert re.search(rf"^\+ export LD_LIBRARY_PATH=.*{re.escape(str(site))}/nvidia/nccl/lib", proc.stdout, re.M)
    # the node's list for the next TE wheelhouse, in the form build --node reads (the same command as --help's)
    assert te_wheels.NODE_COMMAND.split('"')[1] in GPU_CHECK.read_text()
    listed = te_wheels.read_node(tmp_path / "out" / "node.txt")
    assert (listed.torch.version, listed.sm) == (torch.__version__, 90) and "pytest-timeout" in listed.packages
    # the ledger row carries the reason; the suite never ran
    row = (tmp_path / "out" / "ledger_row.md").read_text()
    assert "check stopped: Transformer Engine does not load" in row and "GPU suite not run" in row
    assert not (tmp_path / "out" / "gpu_suite.xml").exists()


@pytest.mark.parametrize("target, message", [
    ("torch=2.11.0+cu130 arch=sm_90", "was built against torch 2.11.0+cu130, this node's is {torch}"),
    ("torch={torch} arch=sm_80", "holds device code for sm_80 only, this GPU is sm_90"),
], ids=["other-torch", "other-gpu"])
def test_a_te_wheelhouse_for_another_torch_or_gpu_stops_before_installing(te_node, tmp_path, target, message):
    env, wheels = te_node
    (wheels / "MANIFEST.txt").write_text(f"# target: python=3.12 {target.format(torch=torch.__version__)} transformer-engine=2.20.2\n")
    proc = check(env)
    assert proc.returncode == 2 and f"error: the TE wheelhouse WHEELS={wheels} " in proc.stderr, proc.stderr[-3000:]
    assert message.format(torch=torch.__version__) in proc.stderr and "tools/te_wheels.py build ../te_wheels --node node.txt" in proc.stderr
    assert not (tmp_path / "venv").exists()


def test_the_plan_with_a_te_wheelhouse_and_without(te_node, tmp_path):
    env, wheels = te_node
    plan = check(env, "--dry-run")
    assert plan.returncode == 0, plan.stderr
    lines = [line[2:] for line in plan.stdout.splitlines() if line.startswith("+ ")]
    assert f"{tmp_path / 'venv'}/bin/python -c 'import transformer_engine.pytorch, megatron.core.extensions.transformer_engine'" in lines
    smoke = f"{tmp_path / 'venv'}/bin/python -c 'import transformer_engine.pytorch as te, torch; l = te.Linear(256, 256)"
    assert any(line.startswith(smoke) for line in lines)
    assert any(line.startswith("export CUDNN_PATH=") for line in lines) and not (tmp_path / "venv").exists()
    # the same node without the TE wheelhouse (and without TE): the plan of before, no TE step
    (wheels / "MANIFEST.txt").unlink()
    env["PYTHONPATH"] = str(tmp_path / "plain")
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "sitecustomize.py").write_text(FAKE_GPU_90)
    plain = check(env, "--dry-run")
    assert plain.returncode == 0 and "transformer_engine" not in plain.stdout and "CUDNN_PATH" not in plain.stdout, plain.stdout


def test_a_max_mib_that_is_not_a_number_exits_2(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("MAX_MIB", "lots")
    assert te_wheels.main(["build", str(tmp_path / "te_wheels"), "--torch", "2.11.0+cu130", "--arch", "sm_90"]) == 2
    assert "MAX_MIB=lots is not a number of MiB" in capsys.readouterr().err
