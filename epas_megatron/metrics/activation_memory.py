"""Measured activation memory: the bytes a forward pass keeps for its backward pass, per layer.

Every tensor autograd saves for backward passes through ``torch.autograd.graph``'s
saved-tensor hooks; :func:`measure_saved_bytes` records each one's *storage* once (a view of a
larger tensor -- e.g. V as a view of the fused QKV output -- keeps the whole storage alive, and
two saves of one storage cost it once), skips parameters (weights are not activations), and
charges it to the decoder layer whose forward was running when it was first saved. A sharing
layer that reuses its source's Q and K therefore costs nothing for them: the source saved them.

What is measured is what this implementation keeps (the local backend's kernels on this
device); :mod:`epas_megatron.metrics.memory_model` predicts it term by term.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class SavedBytes:
    """Bytes saved for backward by one forward pass, by where they were first saved."""

    layers: dict[int, int] = field(default_factory=dict)
    """Decoder layer (global index) -> bytes."""

    outside: int = 0
    """Before the first layer (embedding) and after the last (final norm, LM head, loss)."""

    tensors: dict[int, list[int]] = field(default_factory=dict)
    """Decoder layer -> the bytes of each storage it kept, in the order they were saved."""

    @property
    def total(self) -> int:
        return sum(self.layers.values()) + self.outside


def measure_saved_bytes(model: torch.nn.Module, *inputs, **kwargs) -> SavedBytes:
    """Run ``model(*inputs, **kwargs)`` with gradients and count what it saves (see module
    doc). ``model`` is one EPAS chunk (a ``Float16Module`` too); layers are keyed by their
    global index."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: set[int] = set()
    kept: list[torch.Tensor] = []  # alive until the count is done: no storage address is reused
    result = SavedBytes()
    current: list = [None]
    handles = []
    from epas_megatron.runtime.wrapping import unwrap_model

    for layer in unwrap_model(model).decoder.layers:
        index = layer.layer_number - 1
        result.layers[index] = 0
        result.tensors[index] = []
        handles.append(layer.register_forward_pre_hook(lambda module, args, i=index: current.__setitem__(0, i)))
        handles.append(layer.register_forward_hook(lambda module, args, output: current.__setitem__(0, None)))

    def pack(tensor: torch.Tensor):
        storage = tensor.untyped_storage()
        pointer = storage.data_ptr()
        if pointer not in params and pointer not in seen:
            seen.add(pointer)
            kept.append(tensor)
            if current[0] is None:
                result.outside += storage.nbytes()
            else:
                result.layers[current[0]] += storage.nbytes()
                result.tensors[current[0]].append(storage.nbytes())
        return tensor

    try:
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            model(*inputs, **kwargs)
    finally:
        for handle in handles:
            handle.remove()
    return result
