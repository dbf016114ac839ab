"""The build plan: everything that decides which modules a rank builds for one sharing region.

A :class:`BuildPlan` is made once per region (at start, and again at every switch) and read by
every consumer of "which layer does what, where": the builder (layer specs, chunk placement, p2p
geometry), the stage planner and the FLOPs model (per-layer costs), the layer timer, the
trainer, the benchmarks, evaluation and conversion. It is frozen; a switch makes a new plan with
:meth:`BuildPlan.with_region`.

Normalised here, once:

* the per-layer roles, as :class:`~epas_megatron.sharing.shape.LayerMode` (validated: one
  contiguous region of the plan's :attr:`~BuildPlan.shape`, a source before it);
* the virtual-pipeline size: ``None`` without interleaving (``--vpp 1`` and ``--vpp`` unset
  mean the same), otherwise the number of chunks per rank -- taken from the layout when there
  is one, as Megatron-Core does;
* the pipeline layout, as a :class:`~epas_megatron.model.stage_layout.StageLayout` object (it
  becomes Megatron's layout string only where Megatron's ``TransformerConfig`` takes it).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional, Sequence, TypeVar

from epas_megatron.build_option import BuildOption
from epas_megatron.model.architecture import LlamaArchitecture
from epas_megatron.model.fusions import PRECISIONS
from epas_megatron.model.stage_layout import StageLayout
from epas_megatron.model.v_placement import v_layout_string
from epas_megatron.sharing.shape import LayerMode, RegionShape

O = TypeVar("O", bound=BuildOption)


def normalise_vpp(vpp: Optional[int], layout: Optional[StageLayout] = None) -> Optional[int]:
    """Chunks per pipeline rank, or None without interleaving. A layout decides (its virtual
    stages per rank); otherwise ``--vpp`` values of None and 1 both mean no interleaving."""
    if layout is not None:
        vpp = layout.virtual_pipeline_parallel_size
    return vpp if vpp and vpp > 1 else None


RECOMPUTE_MODULES = ("core_attn", "mlp")
"""Megatron-Core's selective-recompute modules that local and TE layers, computing and sharing,
recompute here."""


@dataclass(frozen=True)
class RecomputeSettings:
    """Activation recomputation (Megatron's ``recompute_*`` settings)."""

    granularity: str = "none"
    """'none', 'selective' (the ``modules``) or 'full' (whole layers)."""

    method: str = "uniform"
    """With 'full': 'uniform' or 'block'."""

    num_layers: int = 1
    """With 'full': layers per recomputed group ('uniform') or recomputed per stage ('block')."""

    modules: tuple[str, ...] = ("core_attn",)
    """With 'selective': Megatron-Core's ``recompute_modules`` (among :data:`RECOMPUTE_MODULES`)."""


@dataclass(frozen=True)
class BuildPlan:
    """What to build for one sharing region: architecture, roles, parallel shape, kernels."""

    arch: LlamaArchitecture
    """The decoder's shape (vocabulary already padded)."""

    modes: tuple[LayerMode, ...]
    """Per decoder layer: computes, computes and hands its Q/K on (source), or shares."""

    seq_length: int
    """Training / evaluation sequence length (sets the p2p tensor's rows)."""

    tp: int = 1
    """Tensor-parallel size."""

    pp: int = 1
    """Pipeline-parallel size."""

    vpp: Optional[int] = None
    """Model chunks per pipeline rank, None without interleaving (see :func:`normalise_vpp`)."""

    layout: Optional[StageLayout] = None
    """Explicit split of the layers over (virtual) stages; None: Megatron's even split."""

    v_stage_sizes: Optional[tuple[int, ...]] = None
    """V placement (a V pipeline schedule, :mod:`epas_megatron.parallel.pipeline_schedule`):
    decoder layers per virtual stage, ``2 * pp`` of them in V order (:mod:`epas_megatron.model.v_placement`);
    None: Megatron's placement (``layout`` / ``vpp``)."""

    sequence_parallel: bool = False
    """Megatron sequence parallelism (needs TP >= 2)."""

    precision: str = "fp32"
    """'fp32', 'bf16' or 'fp16': the parameters' dtype (bf16/fp16 chunks get a Float16Module)."""

    recompute: RecomputeSettings = RecomputeSettings()
    """Activation recomputation."""

    backend: str = "local"
    """Layer classes: 'local' (pure PyTorch Megatron-Core modules) or 'transformer_engine'."""

    core_attention: str = "sdpa"
    """Attention kernel of local layers: 'sdpa' or 'unfused' (Megatron's DotProductAttention)."""

    share: str = "qk"
    """What sharing layers reuse: 'qk' (EPAS) or 'kv' (the KV-sharing ablation)."""

    detach_shared: bool = False
    """Stop gradients through the reused tensors into the source layer."""

    deterministic: bool = False
    """Megatron's deterministic mode (and deterministic kernels where they exist)."""

    shape: Optional[RegionShape] = None
    """Where every region of this plan lies (:class:`~epas_megatron.sharing.shape.RegionShape`:
    ``--epas-exclude-last`` and ``--epas-blocks``): the region built and the ones a switch or an
    evaluation at another size makes from it (:meth:`region_layers`, :meth:`with_region`) are
    derived and validated from it. None: the paper's regions (one block ending at the last
    layer)."""

    options: tuple[BuildOption, ...] = ()
    """The build options this plan has on (:mod:`epas_megatron.build_option`: Mixture-of-Channels,
    Random-LTD, ...), at most one of each kind, in the order the builder applies them."""

    def __post_init__(self):
        if self.shape is None:
            object.__setattr__(self, "shape", RegionShape(self.arch.num_layers))
        elif self.shape.num_layers != self.arch.num_layers:
            raise ValueError(f"BuildPlan: a region shape of {self.shape.num_layers} layers for {self.arch.num_layers} layers")
        if len(self.modes) != self.arch.num_layers:
            raise ValueError(f"BuildPlan: {len(self.modes)} layer modes for {self.arch.num_layers} layers")
        # The modes must be those of a region of this plan's shape
        # (RegionShape.modes raises a ConfigError otherwise).
        expected = self._modes(self.sharing_layers)
        if list(self.modes) != expected:
            raise ValueError(
                f"BuildPlan: layer modes {[str(m) for m in self.modes]} are not those of their sharing region ({expected})"
            )
        kinds = [type(option) for option in self.options]
        if len(set(kinds)) != len(kinds):
            raise ValueError(f"BuildPlan: one option of each kind, got {[kind.__name__ for kind in kinds]}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {self.precision!r}")
        if self.vpp != normalise_vpp(self.vpp, self.layout):
            raise ValueError(f"BuildPlan: vpp {self.vpp!r} is not normalised (use BuildPlan.for_region)")
        if self.v_stage_sizes is not None:
            if self.pp < 2 or self.vpp is not None or self.layout is not None:
                raise ValueError("BuildPlan: V placement needs pp >= 2 and no vpp or interleaved layout")
            if len(self.v_stage_sizes) != 2 * self.pp or sum(self.v_stage_sizes) != self.arch.num_layers:
                raise ValueError(f"BuildPlan: V stage sizes {self.v_stage_sizes} are not a split of {self.arch.num_layers} layers "
                                 f"over 2 x pp = {2 * self.pp} stages")
            if self.arch.tie_embeddings:
                raise ValueError("BuildPlan: V placement puts the embedding and the LM head in two chunks of rank 0; "
                                 "tied embeddings are not supported there yet")
        if self.layout is not None and (
            self.layout.num_layers != self.arch.num_layers or self.layout.pipeline_parallel_size != self.pp
        ):
            raise ValueError(
                f"BuildPlan: layout {self.layout.to_layout_string()!r} is not a split of "
                f"{self.arch.num_layers} layers over pp={self.pp}"
            )

    @classmethod
    def for_region(
        cls,
        arch: LlamaArchitecture,
        sharing_layers: Sequence[int] = (),
        *,
        seq_length: Optional[int] = None,
        vpp: Optional[int] = None,
        layout: Optional[StageLayout] = None,
        shape: Optional[RegionShape] = None,
        **settings,
    ) -> BuildPlan:
        """The plan for ``sharing_layers`` (validated against ``shape``, default the paper's
        regions) with ``vpp`` normalised; ``seq_length`` defaults to the architecture's longest
        sequence; ``settings`` are the other fields."""
        shape = RegionShape(arch.num_layers) if shape is None else shape
        return cls(
            arch=arch,
            modes=tuple(shape.modes(sharing_layers)),
            seq_length=arch.max_sequence_length if seq_length is None else seq_length,
            vpp=normalise_vpp(vpp, layout),
            layout=layout,
            shape=shape,
            **settings,
        )

    def option(self, kind: type[O]) -> Optional[O]:
        """The plan's option of ``kind`` (None: off)."""
        return next((option for option in self.options if type(option) is kind), None)

    def _modes(self, sharing_layers: Sequence[int]) -> list[LayerMode]:
        return self.shape.modes(sharing_layers)

    def with_region(self, sharing_layers: Sequence[int], layout: Optional[StageLayout] = None) -> BuildPlan:
        """The same plan (its region shape included) for another sharing region
        (and pipeline layout), as at a switch."""
        return dataclasses.replace(
            self,
            modes=tuple(self._modes(sharing_layers)),
            layout=layout,
            vpp=normalise_vpp(self.vpp, layout),
        )

    def region_layers(self, size: int, flag: str = "--regions") -> tuple[int, ...]:
        """The sharing layers of a region of ``size`` layers of this plan's shape (what
        :meth:`with_region` takes); a ``ConfigError`` naming ``flag`` if it cannot exist."""
        return self.shape.layers(size, flag=flag)

    @property
    def sharing_layers(self) -> tuple[int, ...]:
        """The layers in sharing mode (a region of :attr:`shape`)."""
        return tuple(i for i, mode in enumerate(self.modes) if mode == LayerMode.SHARE)

    @property
    def region_size(self) -> int:
        """How many layers share."""
        return len(self.sharing_layers)

    @property
    def layout_string(self) -> Optional[str]:
        """The layout in Megatron-Core's ``pipeline_model_parallel_layout`` syntax (None:
        Megatron's even split); under V placement the V stages as ``"V:Ett|t|tt|tL"``
        (:func:`~epas_megatron.model.v_placement.v_layout_string`)."""
        if self.v_stage_sizes is not None:
            return v_layout_string(self.v_stage_sizes)
        return None if self.layout is None else self.layout.to_layout_string()
