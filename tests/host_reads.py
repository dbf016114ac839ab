"""Count what would synchronise a GPU with the host, on a CPU machine.

The GPU suite counts synchronising CUDA calls with PyTorch's sync-debug mode
(``torch.cuda.set_sync_debug_mode('warn')``), which exists only with CUDA. On CPU the same
events are visible one level up: :class:`HostReads` records, with the code that caused them,

* every op that reads a tensor's value into Python (``aten._local_scalar_dense``: ``.item()``,
  ``float(t)``, ``int(t)``, ``bool(t)``) or whose output size depends on values (``nonzero``,
  ``masked_select``, ``unique``) -- through a ``TorchDispatchMode``;
* every copy to the host: ``Tensor.tolist()``, ``.numpy()``, ``.cpu()`` and ``.to('cpu')`` --
  through patched ``Tensor`` methods. On a CPU machine the compute and collective devices *are*
  the CPU, so a ``.to(device)`` with a device object (``compute_device()``,
  ``collective_device()``: the GPU on a GPU) is not a host copy; the string ``'cpu'`` is what
  code writes to bring a value home. The uploads of ``to_compute_device`` are left out by the
  caller passing through :meth:`HostReads.uploads`.

Each event is attributed to the innermost frame in ``epas_megatron`` or Megatron-Core, so a test
can say whose read it is.
"""

from __future__ import annotations

import contextlib
import traceback
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_VALUE_OPS = {"aten::_local_scalar_dense", "aten::nonzero", "aten::masked_select", "aten::_unique2"}
_COPY_METHODS = ("tolist", "numpy", "cpu")


def _origin() -> str:
    """The innermost frame of the project or of Megatron-Core: 'path/to/file.py:function'."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        name = frame.filename.replace("\\", "/")
        for root in ("epas_megatron/", "megatron/core/"):
            if root in name and "tests/host_reads.py" not in name:
                return f"{root}{name.split(root, 1)[1]}:{frame.name}"
    return "elsewhere"


def _is_cpu(device) -> bool:
    return device is not None and torch.device(device).type == "cpu"


class HostReads(TorchDispatchMode):
    """A context that counts host reads (see the module doc): ``events`` is a Counter of
    origin -> reads."""

    def __init__(self):
        super().__init__()
        self.events: Counter = Counter()
        self._uploading = 0
        self._patches = contextlib.ExitStack()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._schema.name in _VALUE_OPS:
            self.events[_origin()] += 1
        return func(*args, **(kwargs or {}))

    @contextlib.contextmanager
    def uploads(self):
        """Copies made inside are uploads to the compute device, not host reads."""
        self._uploading += 1
        try:
            yield
        finally:
            self._uploading -= 1

    def _patch(self):
        counter = self

        def copying(name, original):
            def method(tensor, *args, **kwargs):
                if not counter._uploading:
                    counter.events[_origin()] += 1
                return original(tensor, *args, **kwargs)
            return method

        original_to = torch.Tensor.to

        def to(tensor, *args, **kwargs):
            target = kwargs.get("device")
            for arg in args:
                if isinstance(arg, (str, torch.device)):
                    target = arg
            if isinstance(target, str) and _is_cpu(target) and not counter._uploading:
                counter.events[_origin()] += 1
            return original_to(tensor, *args, **kwargs)

        for name in _COPY_METHODS:
            original = getattr(torch.Tensor, name)
            setattr(torch.Tensor, name, copying(name, original))
            self._patches.callback(setattr, torch.Tensor, name, original)
        torch.Tensor.to = to
        self._patches.callback(setattr, torch.Tensor, "to", original_to)

    def __enter__(self):
        self._patch()
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._patches.close()

    def total(self) -> int:
        return sum(self.events.values())

    def from_project(self) -> Counter:
        return Counter({k: v for k, v in self.events.items() if k.startswith("epas_megatron/")})


CUDA_SYNC = "synchronizing CUDA operation"  # PyTorch's sync-debug message (warn and error modes)


def cuda_syncs(fn) -> int:
    """On a GPU: how many synchronizing CUDA operations ``fn()`` runs (PyTorch's sync-debug
    warnings), what :class:`HostReads` stands in for on CPU."""
    import warnings

    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    return sum(CUDA_SYNC in str(w.message) for w in caught)
