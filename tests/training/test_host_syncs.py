"""No host synchronisation per micro-batch in a training step: the step brings values home in
one copy per iteration (the global loss and token count, and fp16's loss scale, stacked), and
the exit signal is agreed without blocking.

Counted the way the GPU suite counts synchronising CUDA calls, but on CPU
(:mod:`host_reads`: value reads and host copies, each with the code that made it), in real
training iterations of one process; a negative control shows the count sees a per-micro-batch
read."""

from collections import Counter
from pathlib import Path
from unittest import mock

import pytest

import epas_megatron.engine.step as step
from epas_testing import TINY, train_in_process
from host_reads import HostReads

HOST_COPY = "epas_megatron/engine/step.py:_host_values"


def reads_per_iteration(tmp_path: Path, micro_batches: int, extra=(), loss_func=None) -> list[Counter]:
    """The host reads of each training step (``train_step``, optimizer included) of a 3-iteration
    run with ``micro_batches`` micro-batches per iteration and a switch at iteration 2."""
    counts, current = [], []
    real_step, real_upload = step.train_step, step.to_compute_device

    def counted_step(*args, **kwargs):
        reads = HostReads()
        current[:] = [reads]
        with reads:
            result = real_step(*args, **kwargs)
        counts.append(reads.events)
        current.clear()
        return result

    def upload(batch):  # host -> device on a GPU: not a read
        if not current:
            return real_upload(batch)
        with current[0].uploads():
            return real_upload(batch)

    patches = [mock.patch.object(step, "train_step", counted_step), mock.patch.object(step, "to_compute_device", upload)]
    if loss_func is not None:
        patches.append(mock.patch.object(step, "loss_func", loss_func))
    with patches[0], patches[1], (patches[2] if loss_func else mock.MagicMock()):
        train_in_process([*TINY, "--train-iters", "3", "--global-batch-size", str(2 * micro_batches), "--micro-batch-size", "2",
                          "--epas-target-layers", "1", "--epas-interval", "2", "--no-save-final", "--eval-interval", "0",
                          *extra], tmp_path / f"m{micro_batches}")
    assert len(counts) == 3
    return counts


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_a_step_reads_the_host_once_whatever_the_micro_batches(precision, tmp_path):
    """Per iteration the project's code reads the host once (the stacked copy; fp16's loss scale
    rides in it), and nothing -- Megatron's optimizer included -- reads more with four
    micro-batches than with one."""
    few = reads_per_iteration(tmp_path, 1, ["--precision", precision])
    many = reads_per_iteration(tmp_path, 4, ["--precision", precision])
    for iteration, (one, four) in enumerate(zip(few, many), start=1):
        assert Counter({k: v for k, v in four.items() if k.startswith("epas_megatron/")}) == Counter({HOST_COPY: 1}), (iteration, four)
        assert four == one, (iteration, one, four)


def test_the_count_sees_a_read_per_micro_batch(tmp_path):
    """Negative control: a loss function that reads its loss on the host (what the step did
    before: one blocking copy per micro-batch) is counted once per micro-batch."""
    real = step.loss_func

    def reading_loss(loss_mask, output_tensor):
        result = real(loss_mask, output_tensor)
        float(result[2]["lm loss"][0])
        return result

    plain = reads_per_iteration(tmp_path / "plain", 4)
    reading = reads_per_iteration(tmp_path / "reading", 4, loss_func=reading_loss)
    assert [sum(r.values()) - sum(p.values()) for r, p in zip(reading, plain)] == [4, 4, 4]
