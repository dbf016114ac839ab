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

2. **Distributed optimizer over fp32 parameters: every optimizer and DDP ever built stays
   alive.** ``_build_model_and_main_param_groups`` takes a half-precision parameter's shard
   as ``model_param.detach().view(-1)[range]`` but an fp32 parameter's as
   ``model_param.view(-1)[range]``, without the ``detach``: a non-leaf view whose autograd
   node (C++) holds the parameter's ``AccumulateGrad`` node, which carries DDP's backward
   hook, a Python closure over the DDP wrapper. The wrapper keeps the TransformerConfig, whose
   ``grad_scale_func`` is the optimizer's bound ``scale_loss``, and the optimizer keeps the
   shards (its groups and the inner Adam's): a cycle through C++ references that Python's
   collector cannot see, so neither object is ever freed -- at every EPAS switch, in either
   switch mode, the whole training state of the region before (weights, gradient buffer, Adam
   state) stays. Found with weak references to the old DDP, optimizer and gradient buffer
   (alive after the switch and a collection, the DDP referred to by its hooks' closure cells)
   and the shards' ``grad_fn`` (each of DDP's 27 ``grad_accs`` of the test model reachable
   from one). Fix: the fp32 shards are detached as
   well (the same storage and range, the same tensor attributes; the optimizer writes them
   under ``no_grad`` only). Measured: tests/metrics/test_repeated_switches.py.
3. **``RotaryEmbedding.forward`` is an ``lru_cache`` on the method** (up to 32 entries for the
   class, keyed by the module): every model built keeps its rotary module and its
   ``[s, 1, 1, d]`` table in the cache after the model is dropped. Fix:
   :func:`release_dropped_models` clears it; the EPAS switch calls it once the old model is
   gone (the next forward fills it again, for the new model only).
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


def _detach_fp32_shards() -> None:
    """Fix 2: the distributed optimizer's fp32 shards as detached views (like its fp16/bf16 ones)."""
    from megatron.core.optimizer import distrib_optimizer

    cls = distrib_optimizer.DistributedOptimizer
    build_groups = cls._build_model_and_main_param_groups.__func__

    @functools.wraps(build_groups)
    def build_groups_fixed(cls_, gbuf_ranges, param_gbuf_map, opt_group_ranges, config):
        groups = build_groups(cls_, gbuf_ranges, param_gbuf_map, opt_group_ranges, config)
        shard_fp32_groups = groups[3]
        detached = {}
        for group in shard_fp32_groups:
            for index, shard in enumerate(group):
                if shard is not None and shard.grad_fn is not None:
                    leaf = shard.detach()  # the same storage and range, no autograd graph
                    leaf.__dict__.update(shard.__dict__)  # tensor-parallel and optimizer attributes
                    detached[id(shard)] = group[index] = leaf
        for group_range in opt_group_ranges:  # the inner optimizer's groups (built from the same shards)
            params = group_range["orig_group"]["params"]
            group_range["orig_group"]["params"] = [detached.get(id(param), param) for param in params]
        return groups

    cls._build_model_and_main_param_groups = classmethod(build_groups_fixed)


def release_dropped_models() -> None:
    """Fix 3: drop Megatron's per-class caches that hold modules of models no longer in use
    (``RotaryEmbedding.forward``'s ``lru_cache``); call it once the old model objects are gone."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    RotaryEmbedding.forward.cache_clear()


def apply() -> None:
    """Install the fixes (once per process)."""
    global _APPLIED
    if _APPLIED:
        return
    _fix_distributed_optimizer()
    _detach_fp32_shards()
    _APPLIED = True
