"""Files that appear whole or not at all, and a lock for work only one process should do.

Every writer whose output another process may read while it is being written (the data cache,
the checkpoint pointer, the run's ``config.yaml``) writes a temporary file in the *same
directory* and renames it over the final name with ``os.replace``, which is atomic within one
file system: a reader sees the old file or the new one, never a half-written one. On an error
the temporary file is removed and the old file is left as it was.

Temporary names are hidden (``.<name>.<random>.tmp``) and created with the default permissions
(``0o666`` less the umask), so the final file's mode is that of a file opened the ordinary way.
Nothing here calls ``fsync``: a rename survives a crashed process; none of the writers needs
its file to survive a power loss.

:func:`exclusive_lock` is an ``flock`` on a lock file: several processes that find the same
cache entry missing (ranks of a job, concurrent jobs) let one build it while the others wait,
then find it present. Only the standard library is imported here.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import IO

__all__ = [
    "AtomicFiles",
    "atomic_output",
    "atomic_write_bytes",
    "atomic_write_text",
    "exclusive_lock",
]


def _new_temp_path(path: Path) -> Path:
    """Create an empty, hidden, uniquely named file next to ``path``; return its path."""
    while True:
        temp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
        try:
            os.close(os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
        except FileExistsError:
            continue
        return temp


class AtomicFiles:
    """Temporary stand-ins for one or more final paths, renamed onto them by :meth:`commit`.

    The writer fills :attr:`temp_paths` (each next to its final path, created empty), then
    calls :meth:`commit`, or :meth:`discard` to remove them. With several paths the *last* one
    marks a complete set: :meth:`commit` removes it first, renames the others, and renames it
    last, so a reader that finds the last file also finds its companions from the same write
    (an indexed dataset's ``.idx`` is written last and names the layout of its ``.bin``). Each
    rename is atomic; the set as a whole is not.
    """

    def __init__(self, *paths: str | os.PathLike):
        if not paths:
            raise ValueError("AtomicFiles needs at least one path")
        self.paths = tuple(Path(p) for p in paths)
        """Final paths, in the order they are renamed."""
        self.temp_paths: tuple[Path, ...] = ()
        """The temporary files to write, one per final path, in the same directories."""
        created = []
        try:
            for path in self.paths:
                created.append(_new_temp_path(path))
        except BaseException:
            for temp in created:
                temp.unlink(missing_ok=True)
            raise
        self.temp_paths = tuple(created)
        self._committed = False

    def commit(self) -> None:
        """Rename the temporary files onto the final paths (the last path removed first)."""
        if len(self.paths) > 1:
            self.paths[-1].unlink(missing_ok=True)
        for temp, path in zip(self.temp_paths, self.paths):
            os.replace(temp, path)
        self._committed = True

    def discard(self) -> None:
        """Remove whatever temporary files are left (none after a successful commit)."""
        if not self._committed:
            for temp in self.temp_paths:
                temp.unlink(missing_ok=True)


@contextlib.contextmanager
def atomic_output(
    path: str | os.PathLike, mode: str = "w", *, encoding: str | None = None, newline: str | None = None
) -> Iterator[IO]:
    """Open a temporary file next to ``path`` for writing; it becomes ``path`` when the block
    exits without an exception, and is removed otherwise. ``mode`` is ``"w"`` or ``"wb"``;
    text defaults to UTF-8."""
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_output writes a new file: mode 'w' or 'wb', not {mode!r}")
    if mode == "w" and encoding is None:
        encoding = "utf-8"
    files = AtomicFiles(path)
    try:
        with open(files.temp_paths[0], mode, encoding=encoding, newline=newline) as stream:
            yield stream
        files.commit()
    finally:
        files.discard()


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Replace ``path`` with ``data`` atomically (see module doc)."""
    with atomic_output(path, "wb") as stream:
        stream.write(data)


def atomic_write_text(path: str | os.PathLike, text: str, encoding: str = "utf-8") -> None:
    """Replace ``path`` with ``text`` atomically (see module doc)."""
    with atomic_output(path, "w", encoding=encoding) as stream:
        stream.write(text)


@contextlib.contextmanager
def exclusive_lock(lock_path: str | os.PathLike) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``lock_path`` (created, with its directory, if needed)
    for the block; other holders of a lock on the same file wait. The file is left in place
    (removing it would let a late process lock a new file while another holds the old one)."""
    lock_path = Path(lock_path)
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a") as stream:
        fcntl.flock(stream.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(stream.fileno(), fcntl.LOCK_UN)
