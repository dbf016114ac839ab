"""The run configuration: what a run is, checked before anything is built.

- :mod:`.schema`: one dataclass per concern (model, training, parallel, EPAS, data, ...), one
  docstring per field (the ``--help`` text);
- :mod:`.presets`: model shapes from a CPU test model up to LLaMA-2-7B;
- :mod:`.cli`: command line and YAML -> :class:`~epas_megatron.config.schema.RunConfig`;
- :mod:`.validation`: :func:`~epas_megatron.config.validation.resolve_run` checks a config and
  derives everything that needs no process group (world shape, micro-batches, precision, the
  sharing schedule) as a ``ResolvedRun``.

Layering: the first level (config -> model/sharing -> parallel/checkpointing -> training ->
entry points): every other package reads a config, and the schema imports nothing of the
project. Validation consults the pure helpers of the levels above (the sharing schedule and
regions, stage layouts, checkpoint metadata, the data and tokenizer files) to reject a run
before anything starts.
"""
