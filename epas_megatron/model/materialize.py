"""Model chunks built without their weights, and given weights afterwards.

A switch builds the new region's chunks while the old region's weights are still held: built as
usual, the new chunks would hold a second copy of every weight for a moment (the peak of the
switch, not of a step). Built under :func:`parameters_on_meta`, every ``torch.nn.Parameter``
the modules create is on the meta device (the tensor a module made for it is dropped at once:
at most one parameter's storage exists at a time, the largest), while buffers and other
tensors stay where the modules put them. :func:`materialize` then gives each meta parameter real
data -- a tensor the caller already holds (the old parameter of the same identity: adopted, not
copied) or a new, unfilled allocation that a load fills -- before DDP or an optimizer sees the
parameters.

Parameters are replaced in their modules (a meta tensor cannot take real data in place); one
shared by several modules is replaced by one new parameter everywhere, and the attributes
Megatron-Core sets on parameters (tensor-parallel partitioning, ``shared``, ...) move with it.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator, Optional

import torch


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Every ``torch.nn.Parameter`` made inside is on the meta device (same shape, dtype and
    ``requires_grad``); other tensors are unchanged."""
    parameter = torch.nn.Parameter
    original = parameter.__new__

    def new(cls, data=None, requires_grad=True):
        if data is not None and data.device.type != "meta":
            data = torch.empty_like(data, device="meta")
        return original(cls, data, requires_grad)

    parameter.__new__ = new
    try:
        yield
    finally:
        parameter.__new__ = original


def meta_parameters(modules) -> list[tuple[str, torch.nn.Parameter]]:
    """(qualified name, parameter) of every parameter still on the meta device, once each."""
    seen, found = set(), []
    for index, module in enumerate(modules):
        for name, param in module.named_parameters(prefix=f"chunk{index}"):
            if param.is_meta and id(param) not in seen:
                seen.add(id(param))
                found.append((name, param))
    return found


def materialize(modules, device: torch.device,
                tensor_for: Callable[[torch.nn.Parameter], Optional[torch.Tensor]] = lambda param: None) -> dict:
    """Give every meta parameter of ``modules`` data on ``device``: ``tensor_for(param)`` when it
    returns a tensor (of the parameter's shape and dtype, on ``device``: taken over, no copy),
    else a new allocation left unfilled. Buffers are moved to ``device`` (what ``.to(device)``
    does for them). Returns the counts ``{"adopted": n, "allocated": n, "bytes_allocated": n}``."""
    replaced: dict[int, torch.nn.Parameter] = {}
    counts = {"adopted": 0, "allocated": 0, "bytes_allocated": 0}
    for root in modules:
        for module in root.modules():
            for name, param in list(module._parameters.items()):
                if param is None or not param.is_meta:
                    continue
                new = replaced.get(id(param))
                if new is None:
                    data = tensor_for(param)
                    if data is None:
                        data = torch.empty(param.shape, dtype=param.dtype, device=device)
                        counts["allocated"] += 1
                        counts["bytes_allocated"] += data.numel() * data.element_size()
                    else:
                        if data.shape != param.shape or data.dtype != param.dtype or data.device != device:
                            raise ValueError(f"materialize: {name} is {tuple(param.shape)} {param.dtype}, the tensor given "
                                             f"for it {tuple(data.shape)} {data.dtype} on {data.device}")
                        counts["adopted"] += 1
                    new = torch.nn.Parameter(data, requires_grad=param.requires_grad)
                    new.__dict__.update(param.__dict__)
                    replaced[id(param)] = new
                module._parameters[name] = new
            for name, buffer in list(module._buffers.items()):
                if buffer is not None and buffer.device != device:
                    if buffer.is_meta:
                        raise RuntimeError(f"materialize: buffer {name} of {type(module).__name__} is on the meta device "
                                           f"(only parameters are built there)")
                    module._buffers[name] = buffer.to(device)
    return counts
