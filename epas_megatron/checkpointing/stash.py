"""The new gradient buffer as the switch's scratch space.

Between two steps DDP's gradient buffer holds nothing (the next step zeroes it before its first
backward), and a switch builds the new one before the new optimizer: 4 bytes for every
trainable parameter of the new region, about the size of the fp32 optimizer state of one kind
(main weights, or one Adam moment) that the old optimizer holds and the new one needs. The switch
puts the old state of one kind there (:meth:`GradientBufferStash.put`), frees the old tensors
(:func:`release_storage`), lets the new optimizer allocate that kind, and fills it from the
buffer: the optimizer state never exists twice. What does not fit stays where it was (counted by
the memory model as held through the allocation).
"""

from __future__ import annotations

from typing import Optional

import torch


def gradient_buffers(model_chunks) -> list[torch.Tensor]:
    """Every fp32 gradient buffer (``grad_data``) of Megatron DDP-wrapped ``model_chunks``."""
    found = []
    for chunk in model_chunks:
        for buffer in [*getattr(chunk, "buffers", []), *getattr(chunk, "expert_parallel_buffers", [])]:
            data = getattr(buffer, "grad_data", None)
            if data is not None and data.dtype == torch.float32:
                found.append(data)
    return found


class GradientBufferStash:
    """Bump allocation of fp32 tensors in the gradient buffers; :meth:`clear` zeroes what was
    used (the buffer is a gradient buffer again)."""

    def __init__(self, model_chunks):
        self.buffers = gradient_buffers(model_chunks)
        self.used = [0] * len(self.buffers)

    @property
    def capacity(self) -> int:
        """Elements left."""
        return sum(b.numel() - u for b, u in zip(self.buffers, self.used))

    def put(self, tensor: torch.Tensor) -> Optional[torch.Tensor]:
        """A copy of fp32 ``tensor`` in the buffers (its shape), or None when it does not fit in
        what is left of any one buffer."""
        if tensor.dtype != torch.float32:
            return None
        n = tensor.numel()
        for i, buffer in enumerate(self.buffers):
            if buffer.device == tensor.device and self.used[i] + n <= buffer.numel():
                view = buffer[self.used[i]:self.used[i] + n].view(tensor.shape)
                view.copy_(tensor)
                self.used[i] += n
                return view
        return None

    def clear(self) -> None:
        for buffer, used in zip(self.buffers, self.used):
            buffer[:used].zero_()
        self.used = [0] * len(self.buffers)


def release_storage(tensor: torch.Tensor) -> int:
    """Free ``tensor``'s memory now, whoever else refers to it (its storage shrinks to nothing;
    every alias of it is left without data and must not be read). Returns the bytes freed."""
    storage = tensor.untyped_storage()
    freed = storage.nbytes()
    storage.resize_(0)
    return freed
