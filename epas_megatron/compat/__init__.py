"""Compatibility layer: patches to third-party libraries, kept apart from the project's own code.

Everything here changes or works around code we do not own -- Megatron-Core, PyTorch, gloo,
libgomp -- and would be deleted once the library no longer needs it:

- :mod:`.cpu_compat`: CPU stand-ins for Megatron-Core's CUDA-only calls (RNG tracker,
  ``current_device``, literal ``device="cuda"``, streams, CUDA type checks), active only without
  a GPU, so the whole project runs and is tested on a CPU machine;
- :mod:`.device_guard`: the same stand-ins with PyTorch's ``meta`` device in the GPU's place and
  a check that fails where a CPU tensor meets the model, as it would on a GPU (tests only);
- :mod:`.megatron_fixes`: narrow fixes for megatron-core 0.19 bugs a GPU run hits just the same
  (the distributed optimizer's checkpoint loading over ``torch.optim.Adam``);
- :mod:`.gloo_threads`: keeps gloo's worker threads from making OpenMP pools (CPU runs);
- :mod:`.quiet`: filters for known, harmless library warnings and log messages.

Layering: below everything else. These modules import only the standard library, torch and
Megatron-Core; :mod:`epas_megatron.runtime` installs them when it brings up the process groups
(:func:`epas_megatron.runtime.distributed.init_distributed`) and the entry points call
:func:`.quiet.quiet_library_noise` first. Nothing above the runtime imports them directly.
"""
