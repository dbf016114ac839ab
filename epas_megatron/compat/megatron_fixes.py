"""Fixes for megatron-core 0.19 bugs this project runs into, on every device.

Unlike :mod:`epas_megatron.compat.cpu_compat` (CPU stand-ins for CUDA calls), these are
library bugs that a GPU run hits just the same. Each fix is narrow, idempotent, and named
after the code it wraps; :func:`apply` installs them once per process.

1. **Distributed optimizer over ``torch.optim.Adam``, loading a checkpoint.** Without
   Transformer Engine or apex (a plain ``pip`` GPU node, and every CPU machine),
   ``DistributedOptimizer`` wraps PyTorch's Adam, which keeps a per-parameter ``step``
   tensor and no state at all before its first step. Two code paths assume otherwise:

   a. ``sharded_state_dict(is_loading=True)`` calls ``state_dict()``, which reads the
      per-parameter ``step`` and fails with a bare ``assert len(steps) == 1`` on a fresh
      optimizer (at every resume, and at every EPAS switch, which is a save and a load).
      Fix: give a fresh optimizer the state it would have anyway (zero moments, step 0)
      before the load overwrites it.
   b. ``_set_main_param_and_optimizer_states`` copies every *tensor* state of the inner
      optimizer from the loaded per-parameter dict, ``step`` included, but the
      ``fully_reshardable`` loader leaves ``step`` out of that dict on purpose (it is
      restored per group) -> ``KeyError: 'step'``. Fix: entries the loader did not provide
      are skipped, as non-tensor entries already are.
   c. ``load_state_dict`` gives every parameter's state *the same* ``step`` tensor, and
      PyTorch's Adam increments each parameter's ``step`` in place: after any load (a resume,
      or an EPAS switch) the shared counter advances once per parameter per iteration, so Adam's
      bias correction runs with a step that is off by a factor of the parameter count -- wrong
      updates, silently (found by this project's bit-identical-resume test). Fix: after the
      load, every parameter gets its own copy of the step.
"""

from __future__ import annotations

import collections
import functools

import torch

_APPLIED = False


def _seed_fresh_torch_adam(optimizer) -> None:
    """Zero moments and step 0 for every parameter of a distributed optimizer's inner torch
    Adam that has no state yet (fix 1a)."""
    if len(optimizer.optimizer.state) > 0 or optimizer.init_state_fn is None:
        return
    optimizer.init_state_fn(optimizer.optimizer, optimizer.config)
    for group in optimizer.optimizer.param_groups:
        for param in group["params"]:
            optimizer.optimizer.state[param].setdefault("step", torch.tensor(0.0))


def _fix_distributed_optimizer() -> None:
    from megatron.core.optimizer import distrib_optimizer

    cls = distrib_optimizer.DistributedOptimizer
    if distrib_optimizer.HAVE_APEX_OR_TE:
        return  # fused Adam keeps `step` per group: the paths above work as written

    sharded_state_dict = cls.sharded_state_dict

    @functools.wraps(sharded_state_dict)
    def sharded_state_dict_fixed(self, model_sharded_state_dict, is_loading: bool = False, *args, **kwargs):
        if is_loading:
            _seed_fresh_torch_adam(self)
        return sharded_state_dict(self, model_sharded_state_dict, is_loading, *args, **kwargs)

    set_states = cls._set_main_param_and_optimizer_states

    @functools.wraps(set_states)
    def set_states_fixed(self, model_param, tensors):
        # Missing entries read as None, which the method already skips (not a tensor).
        return set_states(self, model_param, collections.defaultdict(lambda: None, tensors))

    load_state_dict = cls.load_state_dict

    @functools.wraps(load_state_dict)
    def load_state_dict_fixed(self, state_dict):
        load_state_dict(self, state_dict)
        for state in self.optimizer.state.values():
            if isinstance(state.get("step"), torch.Tensor):
                state["step"] = state["step"].clone()

    cls.sharded_state_dict = sharded_state_dict_fixed
    cls._set_main_param_and_optimizer_states = set_states_fixed
    cls.load_state_dict = load_state_dict_fixed


def apply() -> None:
    """Install the fixes (once per process)."""
    global _APPLIED
    if _APPLIED:
        return
    _fix_distributed_optimizer()
    _APPLIED = True
