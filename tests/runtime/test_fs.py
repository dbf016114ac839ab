"""runtime/fs.py: atomic replacement of files and the cross-process lock."""

import json
import multiprocessing
import os
import stat
import time

import pytest

from epas_megatron.runtime.fs import (
    AtomicFiles,
    atomic_output,
    atomic_write_bytes,
    atomic_write_text,
    exclusive_lock,
)


class Boom(Exception):
    pass


def test_writes_create_and_replace_files(tmp_path):
    path = tmp_path / "pointer.txt"
    atomic_write_text(path, "100")
    assert path.read_text() == "100"
    atomic_write_text(path, "200")
    assert path.read_text() == "200"
    blob = tmp_path / "model.bin"
    atomic_write_bytes(blob, bytes(range(256)) * 3)
    assert blob.read_bytes() == bytes(range(256)) * 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.bin", "pointer.txt"]


def test_text_is_utf8_by_default_and_newlines_are_kept(tmp_path):
    path = tmp_path / "doc.jsonl"
    with atomic_output(path) as stream:
        stream.write(json.dumps({"text": "naïve → ok"}, ensure_ascii=False) + "\n")
        stream.write("second\n")
    assert path.read_bytes() == '{"text": "naïve → ok"}\nsecond\n'.encode("utf-8")


def test_the_file_appears_only_when_the_block_ends(tmp_path):
    path = tmp_path / "out.txt"
    path.write_text("old")
    with atomic_output(path) as stream:
        stream.write("new")
        stream.flush()
        assert path.read_text() == "old"
        temps = [p for p in tmp_path.iterdir() if p != path]
        assert len(temps) == 1 and temps[0].read_text() == "new"
        assert temps[0].parent == path.parent and temps[0].name.startswith(".out.txt.")
    assert path.read_text() == "new"


@pytest.mark.parametrize("mode", ["w", "wb"])
def test_an_error_mid_write_keeps_the_old_file_and_leaves_no_temp(tmp_path, mode):
    path = tmp_path / "data.txt"
    path.write_text("old content")
    with pytest.raises(Boom):
        with atomic_output(path, mode) as stream:
            stream.write("half" if mode == "w" else b"half")
            raise Boom
    assert path.read_text() == "old content"
    assert list(tmp_path.iterdir()) == [path]


def test_an_error_before_any_file_existed_leaves_nothing(tmp_path):
    with pytest.raises(Boom):
        with atomic_output(tmp_path / "new.bin", "wb"):
            raise Boom
    assert list(tmp_path.iterdir()) == []


def test_the_final_mode_follows_the_umask_like_an_ordinary_file(tmp_path):
    ordinary, atomic = tmp_path / "ordinary", tmp_path / "atomic"
    ordinary.write_text("x")
    atomic_write_text(atomic, "x")
    assert stat.S_IMODE(atomic.stat().st_mode) == stat.S_IMODE(ordinary.stat().st_mode)


def test_only_new_file_modes_are_accepted(tmp_path):
    with pytest.raises(ValueError, match="mode"):
        with atomic_output(tmp_path / "x", "a"):
            pass


def test_a_pair_is_renamed_with_the_last_file_removed_first(tmp_path, monkeypatch):
    bin_file, idx_file = tmp_path / "d.bin", tmp_path / "d.idx"
    bin_file.write_text("old bin")
    idx_file.write_text("old idx")
    files = AtomicFiles(bin_file, idx_file)
    temp_bin, temp_idx = files.temp_paths
    temp_bin.write_text("new bin")
    temp_idx.write_text("new idx")
    seen = []
    real_replace = os.replace

    def spy(src, dst):
        seen.append((os.path.basename(dst), idx_file.exists()))
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", spy)
    files.commit()
    monkeypatch.undo()
    # While the new .bin lands, no .idx (old or new) is there to pair it with.
    assert seen == [("d.bin", False), ("d.idx", False)]
    assert (bin_file.read_text(), idx_file.read_text()) == ("new bin", "new idx")
    files.discard()  # after a commit: nothing to remove, the files stay
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.bin", "d.idx"]


def test_a_discarded_pair_leaves_the_old_files(tmp_path):
    bin_file, idx_file = tmp_path / "d.bin", tmp_path / "d.idx"
    bin_file.write_text("old bin")
    idx_file.write_text("old idx")
    files = AtomicFiles(bin_file, idx_file)
    for temp in files.temp_paths:
        temp.write_text("partial")
    files.discard()
    assert (bin_file.read_text(), idx_file.read_text()) == ("old bin", "old idx")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.bin", "d.idx"]


def _append_markers(lock_path, log_path, worker, rounds):
    for round_index in range(rounds):
        with exclusive_lock(lock_path):
            with open(log_path, "a") as log:
                log.write(f"start {worker} {round_index}\n")
                log.flush()
            time.sleep(0.005)  # give a second holder the chance to write in between
            with open(log_path, "a") as log:
                log.write(f"end {worker} {round_index}\n")


def test_the_lock_keeps_processes_from_overlapping(tmp_path):
    lock_path, log_path = tmp_path / "sub" / "work.lock", tmp_path / "log"
    workers, rounds = 3, 15
    context = multiprocessing.get_context("spawn")  # no torch state forked into the workers
    processes = [
        context.Process(target=_append_markers, args=(lock_path, log_path, w, rounds))
        for w in range(workers)
    ]
    for process in processes:
        process.start()
    for process in processes:
        process.join(timeout=120)
        assert process.exitcode == 0
    lines = log_path.read_text().splitlines()
    assert len(lines) == 2 * workers * rounds
    # Held exclusively, every "start w r" is followed at once by its own "end w r".
    for start, end in zip(lines[0::2], lines[1::2]):
        assert start.startswith("start ") and end == "end " + start[len("start "):]
    assert lock_path.is_file()  # created with its directory, and left in place
