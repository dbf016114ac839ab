"""Documents in and out: the embedded default corpus, and reading documents from .txt/.jsonl.

**The default corpus** is real English prose that every CPython installation carries, so a run
needs no download: the docstrings of the standard library's ``.py`` sources plus the Language
Reference topics stored in ``pydoc_data/topics.py``. Sources are *parsed* with :mod:`ast`, never
imported (importing a stdlib module can have side effects: ``antigravity`` opens a browser).

Decisions:

- **One document per module**: the module, class and function docstrings of one file, in source
  order, joined by blank lines (a module reads as a whole, documents are long enough to pack well
  and the per-document train/valid split of Megatron does not cut a module in two). Each
  ``pydoc_data`` topic is one document of its own.
- **Cleaning**: docstrings are dedented (``ast.get_docstring``), doctest blocks (from a ``>>>``
  line to the next blank line) are dropped, docstrings shorter than :data:`MIN_DOCSTRING_CHARS`
  are dropped, and a docstring or topic already seen in an earlier file is dropped.
- **Skipped directories**: tests, GUI and packaging code, vendored third-party packages and
  generated codecs (:data:`SKIPPED_DIRECTORIES`).
- **Determinism**: files are listed by relative path, sorted, then shuffled with a fixed seed so
  that Megatron's contiguous document split gives a validation set drawn from all of the library
  (not the modules that sort last). Documents are taken in that order until ``max_bytes`` of text
  (UTF-8) is reached; the document that crosses the cap is cut at its last line break that fits,
  then the walk stops (small caps are cheap: later files are never parsed). The result depends only
  on the Python installation's sources, so the cache is keyed on the Python version and the cap.
  CPython 3.12 yields about 1.8 MB, under the default cap of 4 MiB.

**Reading documents** (shared by tokenizer training and preprocessing): ``.jsonl`` files hold one
JSON object per line and the document is the string under ``--json-key``; ``.txt`` files hold one
document per blank-line separated block (``txt_documents="paragraphs"``) or one per file
(``"files"``). Files are read as UTF-8 (invalid bytes become U+FFFD). Blank documents are skipped.
Every bad input raises :class:`ConfigError` naming the flag to change.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import platform
import random
import sys
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

from epas_megatron.errors import ConfigError
from epas_megatron.runtime.fs import atomic_output

__all__ = [
    "DEFAULT_CORPUS_MAX_BYTES",
    "TEXT_SUFFIXES",
    "build_default_corpus",
    "check_input_files",
    "default_corpus_path",
    "file_sha256",
    "iter_documents",
    "iter_file_documents",
    "stdlib_documents",
    "write_jsonl",
]

DEFAULT_CORPUS_MAX_BYTES = 4 * 1024 * 1024
"""Default cap on the UTF-8 size of the default corpus's text."""

MIN_DOCSTRING_CHARS = 40
"""Docstrings shorter than this (after cleaning) are dropped: one-liners carry little prose."""

CORPUS_FORMAT_VERSION = 1
"""Bumped whenever the extraction changes, so cached corpora from older code are not reused."""

CORPUS_SHUFFLE_SEED = 1234
"""Seed of the file order of the default corpus."""

SKIPPED_DIRECTORIES = frozenset(
    {
        "site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3", "tkinter",
        "turtledemo", "ensurepip", "__pycache__", "encodings", "__phello__", "venv",
    }
)
"""Directory names under the standard library that are not walked."""

PYDOC_TOPICS = Path("pydoc_data") / "topics.py"
"""Relative path of the Language Reference topics (a dict literal of prose strings)."""

TEXT_SUFFIXES = (".txt", ".jsonl")
"""Input file types understood by :func:`iter_documents`."""

TXT_DOCUMENT_MODES = ("paragraphs", "files")
"""How a ``.txt`` file is cut into documents: per blank-line separated block, or whole file."""


# ---------------------------------------------------------------------------------------------
# The default corpus
# ---------------------------------------------------------------------------------------------


def stdlib_root() -> Path:
    """Directory of the standard library's sources (the directory of ``os.py``)."""
    return Path(os.__file__).resolve().parent


def stdlib_source_files(root: Path) -> list[Path]:
    """Relative paths of the ``.py`` files under ``root``, sorted, skipped directories left out."""
    files = []
    for directory, subdirectories, names in os.walk(root):
        subdirectories[:] = sorted(
            d
            for d in subdirectories
            if d not in SKIPPED_DIRECTORIES and not d.startswith("config-")
        )
        for name in names:
            if name.endswith(".py"):
                files.append((Path(directory) / name).relative_to(root))
    return sorted(files, key=lambda p: p.as_posix())


def drop_doctest_blocks(text: str) -> str:
    """Remove interactive examples: every run of lines from a ``>>>`` line to the next blank one."""
    kept, in_example = [], False
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith(">>>"):
            in_example = True
        elif not stripped:
            in_example = False
        if not in_example:
            kept.append(line)
    return "\n".join(kept).strip()


def clean_docstring(raw: str) -> str | None:
    """A docstring ready for the corpus, or None when too short to keep."""
    text = drop_doctest_blocks(raw)
    return text if len(text) >= MIN_DOCSTRING_CHARS else None


def definitions(node: ast.AST) -> Iterator[ast.AST]:
    """Class and function definitions under ``node`` in source order, nested ones included
    (also those inside ``if``/``try``/``with`` blocks)."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            yield child
        yield from definitions(child)


def module_docstrings(tree: ast.Module) -> list[str]:
    """The cleaned docstrings of a parsed module (its own, then its definitions'), in order."""
    docstrings = []
    for node in (tree, *definitions(tree)):
        raw = ast.get_docstring(node, clean=True)
        cleaned = clean_docstring(raw) if raw else None
        if cleaned:
            docstrings.append(cleaned)
    return docstrings


def topic_texts(tree: ast.Module) -> list[str]:
    """The string values of the dict literals in ``pydoc_data/topics.py``, in source order."""
    texts = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Dict):
            for value in node.values:
                if isinstance(value, ast.Constant) and isinstance(value.value, str):
                    texts.append(value.value.strip())
    return [t for t in texts if len(t) >= MIN_DOCSTRING_CHARS]


def _parse(path: Path) -> ast.Module | None:
    try:
        return ast.parse(path.read_bytes(), filename=str(path))
    except (SyntaxError, ValueError, OSError, RecursionError):
        return None


def file_documents(root: Path, relative: Path, seen: set[str]) -> list[str]:
    """The corpus documents of one source file; ``seen`` de-duplicates docstrings across files."""
    tree = _parse(root / relative)
    if tree is None:
        return []
    if relative == PYDOC_TOPICS:
        return unseen(topic_texts(tree), seen)
    fresh = unseen(module_docstrings(tree), seen)
    return ["\n\n".join(fresh)] if fresh else []


def unseen(texts: list[str], seen: set[str]) -> list[str]:
    """The texts not in ``seen`` (by hash), in order; ``seen`` is updated."""
    fresh = []
    for text in texts:
        key = hashlib.sha1(text.encode("utf-8")).hexdigest()
        if key not in seen:
            seen.add(key)
            fresh.append(text)
    return fresh


def truncate_utf8(text: str, max_bytes: int) -> str:
    """The longest prefix of ``text`` within ``max_bytes`` (UTF-8) that ends at a line break."""
    if len(text.encode("utf-8")) <= max_bytes:
        return text
    prefix = text.encode("utf-8")[:max_bytes].decode("utf-8", errors="ignore")
    cut = prefix.rfind("\n")
    return prefix[:cut].rstrip() if cut > 0 else ""


def stdlib_documents(
    max_bytes: int = DEFAULT_CORPUS_MAX_BYTES, root: Path | None = None
) -> list[str]:
    """The default corpus's documents, at most ``max_bytes`` of UTF-8 text in all."""
    if max_bytes <= 0:
        raise ConfigError(f"the default corpus needs max_bytes > 0, got {max_bytes}")
    root = stdlib_root() if root is None else root
    files = stdlib_source_files(root)
    random.Random(CORPUS_SHUFFLE_SEED).shuffle(files)
    documents, used, seen = [], 0, set()
    for relative in files:
        for document in file_documents(root, relative, seen):
            room = max_bytes - used
            size = len(document.encode("utf-8"))
            if size > room:
                last = truncate_utf8(document, room)
                if len(last) >= MIN_DOCSTRING_CHARS:
                    documents.append(last)
                return documents
            documents.append(document)
            used += size
    if not documents:
        raise ConfigError(
            f"the standard library at {root} holds no .py sources with docstrings (a zipped or "
            "stripped Python?), so there is no default corpus; pass --data and --tokenizer-model"
        )
    return documents


def write_jsonl(documents: Iterable[str], output_path: Path, key: str = "text") -> Path:
    """Write one ``{key: document}`` object per line, atomically (temp file, then rename)."""
    output_path = Path(output_path)
    output_path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_output(output_path, "w", encoding="utf-8") as stream:
        for document in documents:
            stream.write(json.dumps({key: document}, ensure_ascii=False) + "\n")
    return output_path


def build_default_corpus(output_path: Path, max_bytes: int = DEFAULT_CORPUS_MAX_BYTES) -> Path:
    """Build the default corpus into ``output_path`` (``.jsonl``, key ``text``); return the path."""
    return write_jsonl(stdlib_documents(max_bytes), Path(output_path))


def default_corpus_name(max_bytes: int) -> str:
    """Cache file name: the Python implementation and version and the cap decide the content."""
    version = ".".join(str(v) for v in sys.version_info[:3])
    implementation = platform.python_implementation().lower()
    return f"stdlib-docstrings-v{CORPUS_FORMAT_VERSION}-{implementation}{version}-{max_bytes}.jsonl"


def default_corpus_path(cache_dir: Path, max_bytes: int = DEFAULT_CORPUS_MAX_BYTES) -> Path:
    """Path of the cached default corpus under ``cache_dir``, built on first use.

    Concurrent callers may both build it; the rename is atomic and the content identical.
    """
    path = Path(cache_dir) / default_corpus_name(max_bytes)
    if not path.is_file():
        build_default_corpus(path, max_bytes)
    return path


def file_sha256(path: Path, chunk_bytes: int = 1 << 20) -> str:
    """Hex SHA-256 of a file's bytes (cache keys that follow content, not names)."""
    digest = hashlib.sha256()
    with open(path, "rb") as stream:
        while chunk := stream.read(chunk_bytes):
            digest.update(chunk)
    return digest.hexdigest()


# ---------------------------------------------------------------------------------------------
# Reading documents from .txt / .jsonl
# ---------------------------------------------------------------------------------------------


def expand_inputs(paths: Sequence[Path | str]) -> list[Path]:
    """Input files: files as given, directories replaced by their .txt/.jsonl files (sorted)."""
    files = []
    for raw in paths:
        path = Path(raw)
        if path.is_dir():
            found = sorted(
                (p for p in path.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES),
                key=lambda p: p.as_posix(),
            )
            if not found:
                raise ConfigError(
                    f"--input: directory {path} holds no {'/'.join(TEXT_SUFFIXES)} files"
                )
            files.extend(found)
        else:
            files.append(path)
    return files


def check_input_files(paths: Sequence[Path | str], json_key: str = "text") -> list[Path]:
    """Validate inputs before any heavy work; return the input files in order.

    Raises ConfigError (naming ``--input`` or ``--json-key``) for: no inputs, a missing or empty
    file, an unknown extension, or a ``.jsonl`` whose first record lacks ``json_key``.
    """
    if not paths:
        raise ConfigError("--input: no input files given")
    files = expand_inputs(paths)
    for path in files:
        if not path.is_file():
            raise ConfigError(f"--input: {path} does not exist or is not a file")
        if path.suffix not in TEXT_SUFFIXES:
            raise ConfigError(
                f"--input: {path} has extension {path.suffix or '(none)'!r}; "
                f"supported are {', '.join(TEXT_SUFFIXES)}"
            )
        if path.stat().st_size == 0:
            raise ConfigError(f"--input: {path} is empty")
        if path.suffix == ".jsonl":
            for _ in _jsonl_documents(path, json_key, max_records=1):
                pass
    return files


def split_paragraphs(text: str) -> list[str]:
    """Blank-line separated blocks of ``text``, each stripped, blank ones dropped."""
    blocks, current = [], []
    for line in text.splitlines():
        if line.strip():
            current.append(line)
        elif current:
            blocks.append("\n".join(current).strip())
            current = []
    if current:
        blocks.append("\n".join(current).strip())
    return [b for b in blocks if b]


def _txt_paragraphs(path: Path) -> Iterator[str]:
    """Stream the paragraphs of a text file without reading it whole."""
    current = []
    with open(path, encoding="utf-8", errors="replace") as stream:
        for line in stream:
            if line.strip():
                current.append(line.rstrip("\n"))
            elif current:
                yield "\n".join(current).strip()
                current = []
    if current:
        yield "\n".join(current).strip()


def _jsonl_documents(path: Path, json_key: str, max_records: int | None = None) -> Iterator[str]:
    records = 0
    with open(path, encoding="utf-8", errors="replace") as stream:
        for line_number, line in enumerate(stream, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise ConfigError(
                    f"--input: {path} line {line_number} is not valid JSON ({error.msg}); "
                    "a .jsonl file needs one JSON object per line"
                ) from None
            if not isinstance(record, dict) or json_key not in record:
                keys = sorted(record) if isinstance(record, dict) else type(record).__name__
                raise ConfigError(
                    f"--json-key: {path} line {line_number} has no key {json_key!r} "
                    f"(found {keys}); pass --json-key with the field that holds the text"
                )
            text = record[json_key]
            if not isinstance(text, str):
                raise ConfigError(
                    f"--json-key: {path} line {line_number}: {json_key!r} holds a "
                    f"{type(text).__name__}, not a string"
                )
            yield text
            records += 1
            if max_records is not None and records >= max_records:
                return


def iter_file_documents(
    path: Path, json_key: str = "text", txt_documents: str = "paragraphs"
) -> Iterator[str]:
    """The non-blank documents of one ``.txt`` or ``.jsonl`` file, in file order."""
    path = Path(path)
    if txt_documents not in TXT_DOCUMENT_MODES:
        raise ConfigError(
            f"--txt-documents: {txt_documents!r} is not one of {', '.join(TXT_DOCUMENT_MODES)}"
        )
    if path.suffix == ".jsonl":
        documents = _jsonl_documents(path, json_key)
    elif path.suffix == ".txt" and txt_documents == "paragraphs":
        documents = _txt_paragraphs(path)
    elif path.suffix == ".txt":
        documents = iter([path.read_text(encoding="utf-8", errors="replace").strip()])
    else:
        raise ConfigError(
            f"--input: {path} has extension {path.suffix or '(none)'!r}; "
            f"supported are {', '.join(TEXT_SUFFIXES)}"
        )
    return (d for d in documents if d.strip())


def iter_documents(
    paths: Sequence[Path | str], json_key: str = "text", txt_documents: str = "paragraphs"
) -> Iterator[str]:
    """The documents of all inputs, file after file (see :func:`iter_file_documents`)."""
    for path in expand_inputs(paths):
        yield from iter_file_documents(path, json_key, txt_documents)
