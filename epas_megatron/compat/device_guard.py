"""Catch device-placement bugs on a CPU machine: a CPU tensor reaching a GPU model.

On a CPU machine the model and its inputs share one device, so forgetting to move a batch (or
creating a benchmark input with no ``device=``) goes unnoticed until the first GPU run. A
*device-guard* process closes that gap:

1. :func:`activate` installs the CPU stand-ins with the ``meta`` device in the GPU's place
   (:mod:`epas_megatron.compat.cpu_compat`): parameters, buffers and everything Megatron-Core
   creates on "the current CUDA device" live on ``meta``;
2. :class:`MixedDeviceCheck` (a ``TorchFunctionMode``) raises :class:`DevicePlacementError` when an
   operation combines a ``meta`` tensor with a CPU tensor of one or more dimensions -- the rule
   CUDA applies (0-dim CPU tensors are allowed as scalars, as on CUDA). PyTorch's own meta
   kernels enforce the rule for most operations but not all (``embedding`` with CPU indices and
   a meta weight, for one, passes silently), hence the explicit check. Cross-device copies
   (``to``, ``copy_``) and indexing with CPU indices stay legal, as on CUDA.

Meta tensors hold no data: forward and backward passes run (shapes only), optimizer steps and
anything that reads a value (``.item()``) do not. Use one process per guard run: the stand-in
device is fixed for the life of a process.
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from epas_megatron.compat import cpu_compat

GUARD_DEVICE = torch.device("meta")

# Operations that legitimately take tensors on two devices (CUDA allows them too).
_CROSS_DEVICE_OK = {
    torch.Tensor.to,
    torch.Tensor.copy_,
    torch.Tensor.__getitem__,
    torch.Tensor.__setitem__,
    torch.Tensor.index_put_,
    torch.Tensor.new_tensor,
    torch.Tensor.set_,
}


class DevicePlacementError(RuntimeError):
    """A CPU tensor met a tensor on the (stand-in) accelerator in one operation."""


def _name(func) -> str:
    return getattr(func, "__qualname__", None) or getattr(func, "__name__", repr(func))


class MixedDeviceCheck(TorchFunctionMode):
    """Raise on operations that mix ``meta`` tensors with non-scalar CPU tensors."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in _CROSS_DEVICE_OK:
            leaves, _ = tree_flatten((args, kwargs))
            tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
            on_guard = any(t.device.type == GUARD_DEVICE.type for t in tensors)
            stray = [t for t in tensors if t.device.type == "cpu" and t.dim() > 0]
            if on_guard and stray:
                shapes = ", ".join(f"{tuple(t.shape)} {t.dtype}" for t in stray)
                raise DevicePlacementError(
                    f"{_name(func)} got CPU tensor(s) [{shapes}] together with tensors on the model's device: "
                    "on a GPU this fails; move the input with epas_megatron.runtime.device.to_compute_device "
                    "or create it on compute_device()"
                )
        return func(*args, **kwargs)


def activate() -> MixedDeviceCheck:
    """Make this process a device-guard process; returns the check mode to enter (``with``)."""
    if torch.cuda.is_available():
        raise RuntimeError("the device guard stands in for a GPU; this machine has one, run there instead")
    cpu_compat.activate(stand_in=GUARD_DEVICE.type)
    return MixedDeviceCheck()
