"""runtime/garbage.py: what is frozen is skipped by the collector until it is unfrozen, only the
first freeze owns the set, and the trainer freezes once (its first build) and unfreezes at the end."""

import gc
import weakref

import pytest

from epas_megatron.runtime import garbage


class Node:
    pass


def cycle() -> Node:
    """An object only the cyclic collector can free (it refers to itself)."""
    node = Node()
    node.me = node
    return node


@pytest.fixture
def own_frozen_set(monkeypatch):
    """This test owns the collector's frozen set: the session's (tests/conftest.py) is released
    here and everything alive is frozen again after."""
    gc.unfreeze()
    monkeypatch.setattr(garbage, "_frozen", False)
    yield
    gc.collect()
    gc.freeze()


def test_frozen_cycles_wait_for_the_owners_unfreeze_and_new_ones_are_collected(own_frozen_set):
    old = weakref.ref(keep := cycle())
    assert garbage.freeze_long_lived() is True
    assert garbage.freeze_long_lived() is False  # a frozen set is in effect: this call owns nothing

    del keep
    gc.collect()
    assert old() is not None  # frozen: the collector skips it
    new = weakref.ref(cycle())
    gc.collect()
    assert new() is None  # made after the freeze: collected as usual

    garbage.unfreeze_long_lived(False)  # not the owner: nothing changes
    gc.collect()
    assert old() is not None
    garbage.unfreeze_long_lived(True)
    gc.collect()
    assert old() is None
    assert garbage.freeze_long_lived() is True  # unfrozen: the next run may freeze again
    garbage.unfreeze_long_lived(True)


def test_the_trainer_freezes_at_its_first_build_only_and_unfreezes_at_the_end(monkeypatch, tmp_path):
    from epas_megatron.training import trainer
    from epas_testing import TINY, run_trainer

    calls = []
    monkeypatch.setattr(trainer, "freeze_long_lived", lambda: calls.append("freeze") or True)
    monkeypatch.setattr(trainer, "unfreeze_long_lived", lambda froze: calls.append(("unfreeze", froze)))
    args = [*TINY, "--train-iters", "7", "--global-batch-size", "2", "--micro-batch-size", "2", "--epas-target-layers", "2",
            "--epas-interval", "3"]
    run = run_trainer(args, tmp_path / "run", in_process=True)
    assert [s["sharing_layers"] for s in run.switches] == [[3], [2, 3]]  # three builds
    assert calls == ["freeze", ("unfreeze", True)]
