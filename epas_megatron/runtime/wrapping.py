"""The model chunk inside its training wrappers.

A chunk is trained as ``DDP(Float16Module(EpasGPTModel))`` (either wrapper may be absent); both
Megatron-Core wrappers keep the wrapped module in ``.module``. Only the standard library is
imported here, so checkpoint and benchmark code can use it without loading Megatron-Core.
"""

from __future__ import annotations


def unwrap_model(module):
    """The innermost module under any DDP / ``Float16Module`` wrappers (``module`` if none)."""
    while hasattr(module, "module"):
        module = module.module
    return module
