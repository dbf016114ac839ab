"""Python's cyclic garbage collector during a training run.

Megatron-Core's DDP wrapper and optimizer hold reference cycles, so the trainer runs a full
collection before it builds a region's model (training/trainer.py): the previous region's model
and optimizer go before the new ones come. A full collection walks every object the process
tracks -- about 500,000 once torch, Megatron-Core and transformers are imported, 0.23 s of one CPU
core each time (measured on this project's 2-core CPU machine), at every switch and in every
automatic full collection. What exists when the first model is built (modules, configuration,
the data pipeline) lives as long as the run, so it is frozen (``gc.freeze``: moved to a
generation that collections skip) and collections walk only what training creates.

Reference counting still frees frozen objects; only a frozen reference cycle that dies during the
run waits, until :func:`unfreeze_long_lived` at the end of the run.
"""

from __future__ import annotations

import gc

_frozen = False
"""Whether a :func:`freeze_long_lived` is in effect in this process (inherited by forked children)."""


def freeze_long_lived() -> bool:
    """Collect, then freeze every object that survived; returns True. Where an earlier call's
    frozen set is in effect (a process forked from a server that froze its imports, a test
    session) it does nothing and returns False: that call's owner unfreezes it, or never does."""
    global _frozen
    if _frozen:
        return False
    gc.collect()
    gc.freeze()
    _frozen = True
    return True


def unfreeze_long_lived(froze: bool) -> None:
    """Undo :func:`freeze_long_lived` if that call (its result ``froze``) froze anything."""
    global _frozen
    if froze:
        gc.unfreeze()
        _frozen = False
