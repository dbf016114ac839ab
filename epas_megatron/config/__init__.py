"""The run configuration as data: what a run is, before anything is checked against a world.

- :mod:`.schema`: one dataclass per concern (model, training, parallel, EPAS, data, ...), one
  docstring per field (the ``--help`` text);
- :mod:`.presets`: model shapes from a CPU test model up to LLaMA-2-7B;
- :mod:`.cli`: command line and YAML -> :class:`~epas_megatron.config.schema.RunConfig`;
- :mod:`.reference`: the configuration reference page, generated from the field docstrings.

Layering: the bottom of the project's levels (tests/test_layering.py); it imports nothing of the
project but errors and runtime. Resolving a run -- checking a config against the world, the data,
the checkpoint it resumes, and deriving what needs no process group -- is
:mod:`epas_megatron.validation`, beside the assembly.
"""
