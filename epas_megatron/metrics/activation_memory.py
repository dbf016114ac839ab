"""Measured activation memory: the bytes a forward pass keeps for its backward pass, per layer.

Every tensor autograd saves for backward passes through ``torch.autograd.graph``'s
saved-tensor hooks; :func:`measure_saved_bytes` records each one's *storage* once (a view of a
larger tensor -- e.g. V as a view of the fused QKV output -- keeps the whole storage alive, and
two saves of one storage cost it once), skips parameters (weights are not activations), and
charges it to the decoder layer whose forward was running when it was first saved. A sharing
layer that reuses its source's Q and K therefore costs nothing for them: the source saved them.

What is measured is what this implementation keeps (the local backend's kernels on this
device); :mod:`epas_megatron.metrics.memory_model` predicts it term by term.

:class:`LiveSavedBytes` follows the same bytes *over time* -- through a whole pipelined iteration,
many passes in flight: each saved tensor is packed into a small holder that autograd keeps as
long as it keeps the saved tensor (to the end of its node's backward, or until the graph is
dropped) and whose release takes its count back; the weight-gradient GEMMs a split backward
defers (:data:`~epas_megatron.model.weight_grad.WEIGHT_GRAD_STORE`) hold their layer's input and
output gradient from ``B`` to ``W``, counted the same way. A storage is counted once while
anything holds it; the peak is what the pipeline schedule's memory accounting predicts
(:func:`~epas_megatron.metrics.rank_memory.rank_memory_bytes`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Iterable, Iterator

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


class _Held:
    """One hold on a storage: released (its count taken back) when the holder is dropped."""

    __slots__ = ("tensor", "_tracker", "_pointer")

    def __init__(self, tracker: "LiveSavedBytes", pointer: int, tensor: torch.Tensor):
        self.tensor, self._tracker, self._pointer = tensor, tracker, pointer

    def __del__(self):
        self._tracker._release(self._pointer)


class LiveSavedBytes:
    """Live bytes kept for backward on this process, and their peak (see the module doc).

    ``with tracker.tracking():`` installs the saved-tensor hooks (and the weight-gradient store's
    hook); every tensor saved inside is held through a :class:`_Held` until autograd (or a
    deferred GEMM) drops it. Storages are de-duplicated (a storage held twice counts once) and
    ``parameters`` are skipped. :attr:`current` and :attr:`peak` are bytes; :meth:`reset_peak`
    starts a new peak from what is live."""

    def __init__(self, parameters: Iterable[torch.Tensor] = ()):
        self._skip = {p.untyped_storage().data_ptr() for p in parameters}
        self._live: dict[int, list[int]] = {}  # storage address -> [holds, bytes]
        self.current = 0
        self.peak = 0

    def hold(self, tensor: torch.Tensor):
        """A hold on ``tensor``'s storage (the tensor itself if it is a parameter's)."""
        storage = tensor.untyped_storage()
        pointer = storage.data_ptr()
        if pointer in self._skip:
            return tensor
        entry = self._live.get(pointer)
        if entry is None:  # (the holds keep the storage alive: its address is not reused meanwhile)
            entry = self._live[pointer] = [0, storage.nbytes()]
            self.current += entry[1]
            self.peak = max(self.peak, self.current)
        entry[0] += 1
        return _Held(self, pointer, tensor)

    def hold_all(self, tensors: tuple[torch.Tensor, ...]) -> list:
        """Holds on several tensors (the weight-gradient store's hook)."""
        return [self.hold(t) for t in tensors if t is not None]

    def _release(self, pointer: int) -> None:
        entry = self._live[pointer]
        entry[0] -= 1
        if entry[0] == 0:
            del self._live[pointer]
            self.current -= entry[1]

    def reset_peak(self) -> None:
        self.peak = self.current

    @staticmethod
    def _unpack(packed):
        return packed.tensor if isinstance(packed, _Held) else packed

    @contextlib.contextmanager
    def tracking(self) -> Iterator["LiveSavedBytes"]:
        from epas_megatron.model.weight_grad import WEIGHT_GRAD_STORE

        if WEIGHT_GRAD_STORE.on_put is not None:
            raise RuntimeError("another tracker already follows the weight-gradient store")
        WEIGHT_GRAD_STORE.on_put = self.hold_all
        try:
            with torch.autograd.graph.saved_tensors_hooks(self.hold, self._unpack):
                yield self
        finally:
            WEIGHT_GRAD_STORE.on_put = None
