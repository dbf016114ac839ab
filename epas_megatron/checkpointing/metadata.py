"""A checkpoint's run metadata (``run_meta.json``) as one typed object, written and read here.

Every reader -- resume checks, the trainer's load, evaluation, generation, lm-eval, conversion --
gets a :class:`CheckpointMeta` from :meth:`CheckpointMeta.from_dict` instead of reading keys
with its own defaults. Compatibility with older checkpoints lives in that one method:

* ``epas_share`` absent (before the KV-sharing ablation): 'qk';
* ``exclude_last`` absent from the saved schedule (before ``--epas-exclude-last`` existed): the
  saved config's, else 0 -- those regions ended at the last layer;
* ``blocks`` absent likewise (before ``--epas-blocks``): the saved config's, else 1 (one block);
* ``parallel`` / ``precision`` / ``backend`` / ``config`` absent (a Hugging Face import): None;
* ``has_optimizer_state`` absent (before weights-only checkpoints): True.
* ``features`` absent (before training features wrote their own records): the top-level
  ``random_ltd``, ``epas_switch_rewarm`` and ``epas_switch_ramp`` entries of those checkpoints
  (:data:`LEGACY_FEATURE_KEYS`) are read into it once, here; a feature absent from it was off
  (also every checkpoint written before the feature existed).

Unknown keys are kept in :attr:`CheckpointMeta.extra` and written back unchanged.
:func:`~epas_megatron.checkpointing.checkpoint.save_checkpoint` adds ``iteration`` and
``has_optimizer_state`` when it writes the file (they describe the save, not the run).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional

from epas_megatron.config.cli import from_dict
from epas_megatron.sharing.shape import RegionShape

MODEL_FIELDS = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size", "vocab_size",
                "untie_embeddings_and_output_weights", "moc_topk", "moc_groups")
"""The ``ModelConfig`` fields a checkpoint records and a resume or ``--pretrained`` must match."""

LEGACY_FEATURE_KEYS = ("random_ltd", "epas_switch_rewarm", "epas_switch_ramp")
"""Training features whose records older checkpoints wrote at the top level of ``run_meta.json``."""

MODEL_FIELD_DEFAULTS = {"moc_topk": 1.0, "moc_groups": 8}
"""What a checkpoint written before a field existed had (older checkpoints are dense MLPs)."""


def model_record(model_cfg) -> dict[str, Any]:
    """The ``model`` entry of a checkpoint: :data:`MODEL_FIELDS` of a ``ModelConfig``."""
    return {name: getattr(model_cfg, name) for name in MODEL_FIELDS}


@dataclass(frozen=True)
class SavedParallel:
    """The parallel layout a checkpoint was saved from (it loads into any other)."""

    tp: int = 1
    """Tensor-parallel size."""

    pp: int = 1
    """Pipeline-parallel size."""

    dp: int = 1
    """Data-parallel size."""

    vpp: Optional[int] = None
    """Model chunks per pipeline rank (None without interleaving)."""

    layout: Optional[str] = None
    """The pipeline layout in Megatron's syntax (None: the even split)."""

    use_distributed_optimizer: Optional[bool] = None
    """Whether the optimizer state is in the distributed optimizer's format (None: not recorded)."""

    def same_sizes(self, tp: int, pp: int, dp: int) -> bool:
        """Whether a world of these sizes matches (the RNG states then load rank for rank)."""
        return (self.tp, self.pp, self.dp) == (tp, pp, dp)


@dataclass(frozen=True)
class CheckpointMeta:
    """What a checkpoint records about the run that wrote it."""

    model: dict[str, Any]
    """The model's shape (:func:`model_record`)."""

    iteration: int = 0
    """Iterations completed when it was saved."""

    config: Optional[dict] = None
    """The resolved run config, sectioned (:func:`epas_megatron.config.cli.to_dict`); None for
    imports from Hugging Face that carry only the model section's source."""

    parallel: Optional[SavedParallel] = None
    """The layout it was saved from (None: an import)."""

    precision: Optional[str] = None
    """'fp32', 'bf16' or 'fp16' (None: an import, fp32 weights)."""

    backend: Optional[str] = None
    """Layer backend of the run: 'local' or 'transformer_engine' (None: an import)."""

    epas_schedule: Optional[dict] = None
    """The sharing schedule's state (:meth:`~epas_megatron.sharing.schedule.SharingSchedule.state_dict`)."""

    features: dict[str, dict] = field(default_factory=dict)
    """Each training feature's own record, by the feature's name, written and read by the feature
    (:class:`~epas_megatron.training.features.TrainingFeature`); a feature the run had off has
    none. This module does not interpret them."""

    epas_share: str = "qk"
    """What the sharing layers reuse: 'qk' or 'kv'."""

    sharing_layers: tuple[int, ...] = ()
    """The sharing region it was trained up to (saved with)."""

    tokenizer_model: Optional[str] = None
    """The sentencepiece model of its data."""

    consumed_samples: int = 0
    """Training samples consumed."""

    has_optimizer_state: bool = True
    """False for weights-only checkpoints (imports, saves before the first optimizer step)."""

    extra: dict[str, Any] = field(default_factory=dict)
    """Keys this version does not interpret (e.g. ``imported_from``), kept as written."""

    @classmethod
    def from_dict(cls, record: dict[str, Any]) -> "CheckpointMeta":
        """Read a ``run_meta.json`` record (any version; see the module doc for the defaults)."""
        known = ({f.name for f in dataclasses.fields(cls)} - {"extra"}) | set(LEGACY_FEATURE_KEYS)
        parallel = record.get("parallel")
        return cls(
            model=dict(record.get("model") or {}),
            iteration=int(record.get("iteration", 0)),
            config=record.get("config"),
            parallel=SavedParallel(**parallel) if parallel is not None else None,
            precision=record.get("precision"),
            backend=record.get("backend"),
            epas_schedule=record.get("epas_schedule"),
            features={**{key: record[key] for key in LEGACY_FEATURE_KEYS if record.get(key) is not None},
                      **(record.get("features") or {})},
            epas_share=record.get("epas_share") or "qk",
            sharing_layers=tuple(record.get("sharing_layers") or ()),
            tokenizer_model=record.get("tokenizer_model"),
            consumed_samples=int(record.get("consumed_samples") or 0),
            has_optimizer_state=bool(record.get("has_optimizer_state", True)),
            extra={key: value for key, value in record.items() if key not in known},
        )

    def to_dict(self) -> dict[str, Any]:
        """The ``run_meta.json`` record (None-valued optional entries are left out, as imports
        have always written them)."""
        record: dict[str, Any] = {
            "model": dict(self.model),
            "iteration": self.iteration,
            "config": self.config,
            "parallel": dataclasses.asdict(self.parallel) if self.parallel is not None else None,
            "precision": self.precision,
            "backend": self.backend,
            "epas_schedule": self.epas_schedule,
            "features": {name: state for name, state in self.features.items() if state is not None},
            "epas_share": self.epas_share,
            "sharing_layers": list(self.sharing_layers),
            "tokenizer_model": self.tokenizer_model,
            "consumed_samples": self.consumed_samples,
            "has_optimizer_state": self.has_optimizer_state,
        }
        optional = ("config", "parallel", "precision", "backend", "epas_schedule")
        record = {key: value for key, value in record.items() if not (key in optional and value is None)}
        return {**record, **self.extra}

    @property
    def num_layers(self) -> int:
        """Decoder layers."""
        return int(self.model["num_layers"])

    @property
    def trained_region(self) -> int:
        """How many layers share in the saved region (the largest region it was trained with)."""
        return len(self.sharing_layers)

    @property
    def exclude_last(self) -> int:
        """The ``--epas-exclude-last`` it was trained with: every region built from it ends at
        layer ``num_layers - 1 - exclude_last`` (see the module doc for older checkpoints)."""
        schedule = self.epas_schedule or {}
        if "exclude_last" in schedule:
            return int(schedule["exclude_last"])
        return int((self.config or {}).get("epas", {}).get("epas_exclude_last", 0))

    @property
    def blocks(self) -> int:
        """The ``--epas-blocks`` it was trained with: every region built from it has that many
        blocks (:func:`~epas_megatron.sharing.shape.region_layers`); 1 for older checkpoints."""
        schedule = self.epas_schedule or {}
        if "blocks" in schedule:
            return int(schedule["blocks"])
        return int((self.config or {}).get("epas", {}).get("epas_blocks", 1))

    @property
    def shape(self) -> RegionShape:
        """Where every region built from it lies (its layers, :attr:`exclude_last`, :attr:`blocks`)."""
        return RegionShape.of(self)

    def run_config(self):
        """The saved run config as a :class:`~epas_megatron.config.schema.RunConfig` (needs
        :attr:`config`; :func:`~epas_megatron.checkpointing.integrity.open_checkpoint` with
        ``needs_config`` guarantees it)."""
        if self.config is None:
            raise ValueError("this checkpoint records no run config")
        return from_dict(self.config)
