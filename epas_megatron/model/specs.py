"""Layer specs: which module fills each slot of a decoder layer, per backend and per EPAS role.

A backend is a Megatron-Core ``BackendSpecProvider`` (``megatron/core/models/backends.py``):
:func:`layer_spec` builds the ``ModuleSpec`` of a layer for a
:class:`~epas_megatron.sharing.shape.LayerMode` -- ``compute``, ``source`` (computing, and hands
its Q/K on) or ``share`` -- by asking the provider for each slot (``fuse_layernorm_and_linear``,
``column_parallel_layer_norm_linear``, ``column_parallel_linear``, ``row_parallel_linear``,
``core_attention``, ``layer_norm(rms_norm=True)``), so local and TE layers share everything but
the provider, and upstream fixes to Megatron's providers reach our layers. :func:`get_backend`
chooses one per ``--transformer-impl`` and ``--core-attention``:

* local: :class:`EpasLocalSpecProvider`, Megatron's ``LocalSpecProvider`` with three overrides --
  the linears are :class:`~epas_megatron.model.weight_grad.DelayedWgradColumnParallelLinear` /
  :class:`~epas_megatron.model.weight_grad.DelayedWgradRowParallelLinear` (Megatron's, subclassed
  for the weight-gradient split of the split-backward pipeline schedules); the RMSNorm is
  :class:`~epas_megatron.model.norm.RMSNorm` (Megatron's local norm refuses sequence
  parallelism); the core attention is :class:`~epas_megatron.model.core_attention.SDPAttention`
  or Megatron's ``DotProductAttention`` per ``--core-attention``. Everything else is Megatron's.
* transformer_engine: Megatron's ``TESpecProvider``, unchanged (a subclass adds only
  :attr:`norm`, below). Its module is imported when the TE backend is chosen, as Megatron's own
  ``get_backend`` does; without Transformer Engine installed its classes are Megatron's
  placeholders, the same objects Megatron's own TE layer spec holds, so building a TE spec imports
  no ``transformer_engine`` (the layer itself is built on a GPU node).

Both providers also have ``norm`` (:class:`_BlockNorm`), the RMSNorm after the last layer that the
builder puts in the transformer block.

Where a backend fuses the norm into the following GEMM (TE's ``LayerNormColumnParallelLinear``),
the input norm lives in ``linear_qkv`` (computing) or ``linear_v``/``linear_q`` (sharing) and the
layer's ``input_layernorm`` is an identity; the sharded-state-dict key maps make all four
variants save the norm under the same key, ``self_attention.linear_qkv.layer_norm_weight``.
"""

from __future__ import annotations

from functools import cache, partial
from typing import Sequence

from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.models.backends import BackendSpecProvider, LocalSpecProvider
from megatron.core.transformer.attention import SelfAttentionSubmodules
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import LayerNormBuilder
from megatron.core.transformer.transformer_layer import TransformerLayerSubmodules

from epas_megatron.model.attention import (
    _OWN_PART,
    ComputingAttention,
    FrozenProjection,
    SharedAttention,
    SharedAttentionSubmodules,
)
from epas_megatron.model.core_attention import CORE_ATTENTION_CHOICES, SDPAttention
from epas_megatron.model.layer import EpasTransformerLayer
from epas_megatron.model.norm import RMSNorm
from epas_megatron.model.weight_grad import DelayedWgradColumnParallelLinear, DelayedWgradRowParallelLinear
from epas_megatron.sharing.shape import LayerMode

BACKEND_NAMES = ("local", "transformer_engine")
"""The values of ``--transformer-impl`` that :func:`get_backend` knows."""

# Core attention of local layers per --core-attention (Transformer Engine chooses its own kernel).
_LOCAL_CORE_ATTENTION = {"sdpa": SDPAttention, "unfused": DotProductAttention}
assert set(_LOCAL_CORE_ATTENTION) == set(CORE_ATTENTION_CHOICES)


class _BlockNorm:
    """What the builder asks of a provider beyond Megatron's protocol: :attr:`norm`."""

    @property
    def norm(self) -> LayerNormBuilder:
        """The RMSNorm after the last layer (the transformer block's ``layer_norm``), the same
        module as an unfused layer norm: ``layer_norm(rms_norm=True)``."""
        return self.layer_norm(rms_norm=True)


class EpasLocalSpecProvider(_BlockNorm, LocalSpecProvider):
    """Megatron-Core's ``LocalSpecProvider`` with EPAS's linears, RMSNorm and core attention
    (see the module doc for why each differs); every other answer is Megatron's."""

    def __init__(self, core_attention: str = "sdpa"):
        """``core_attention``: 'sdpa' (PyTorch's fused kernels, :class:`SDPAttention`) or
        'unfused' (Megatron-Core's ``DotProductAttention``, which materialises the scores)."""
        if core_attention not in _LOCAL_CORE_ATTENTION:
            raise ValueError(f"unknown core attention {core_attention!r}; expected one of {CORE_ATTENTION_CHOICES}")
        self.core_attention_name = core_attention

    def __repr__(self) -> str:
        return f"{type(self).__name__}(core_attention={self.core_attention_name!r})"

    def column_parallel_linear(self) -> type:
        """Megatron's ``ColumnParallelLinear`` with the weight-gradient split."""
        return DelayedWgradColumnParallelLinear

    def row_parallel_linear(self) -> type:
        """Megatron's ``RowParallelLinear`` with the weight-gradient split."""
        return DelayedWgradRowParallelLinear

    def layer_norm(self, rms_norm: bool = False, for_qk: bool = False, has_residual: bool = False) -> LayerNormBuilder:
        """RMSNorm: ours, which allows sequence parallelism; LayerNorm: Megatron's."""
        if rms_norm:
            return RMSNorm
        return super().layer_norm(rms_norm, for_qk, has_residual)

    def core_attention(self) -> type:
        """:class:`SDPAttention` or Megatron's ``DotProductAttention``, per ``--core-attention``."""
        return _LOCAL_CORE_ATTENTION[self.core_attention_name]


LOCAL = EpasLocalSpecProvider()
"""The local provider with the default core attention (SDPA)."""


@cache
def _transformer_engine_provider_class() -> type:
    """Megatron's ``TESpecProvider`` plus :attr:`_BlockNorm.norm`, defined (and Megatron's
    provider module imported) on first use."""
    from megatron.core.extensions.transformer_engine_spec_provider import TESpecProvider

    class EpasTESpecProvider(_BlockNorm, TESpecProvider):
        """Megatron-Core's ``TESpecProvider``, every answer unchanged. The subclass exists only
        for :attr:`norm` (the transformer block's final norm, which the builder asks every
        backend for: TENorm here)."""

    return EpasTESpecProvider


def get_backend(name: str, core_attention: str = "sdpa") -> BackendSpecProvider:
    """The spec provider of backend ``name`` ('local' or 'transformer_engine'); for local layers
    with the core attention ``core_attention`` ('sdpa': PyTorch's fused kernels, 'unfused':
    Megatron-Core's ``DotProductAttention``, which materialises the scores)."""
    if name not in BACKEND_NAMES:
        raise ValueError(f"unknown backend {name!r}; expected one of {sorted(BACKEND_NAMES)}")
    if core_attention not in _LOCAL_CORE_ATTENTION:
        raise ValueError(f"unknown core attention {core_attention!r}; expected one of {CORE_ATTENTION_CHOICES}")
    if name == "local":
        return EpasLocalSpecProvider(core_attention)
    return _transformer_engine_provider_class()()


def layer_spec(mode: LayerMode | str, backend: BackendSpecProvider = LOCAL, share: str = "qk",
               detach_shared: bool = False) -> ModuleSpec:
    """The spec of one decoder layer in ``mode`` (a :class:`LayerMode` or its value), its modules
    from ``backend`` (a provider from :func:`get_backend`). Build options change it afterwards
    (:meth:`~epas_megatron.build_option.BuildOption.layer_spec`: Mixture-of-Channels' MLP, the
    switch ramp's blending attention)."""
    try:
        role = LayerMode(mode)
    except ValueError:
        raise ValueError(f"unknown layer mode {mode!r}; expected one of {[str(m) for m in LayerMode]}") from None
    fused = backend.fuse_layernorm_and_linear()
    norm = IdentityOp if fused else backend.layer_norm(rms_norm=True)
    input_linear = backend.column_parallel_layer_norm_linear() if fused else backend.column_parallel_linear()
    output_linear = backend.row_parallel_linear()
    core_attention = backend.core_attention()
    if role == LayerMode.SHARE:
        attention = ModuleSpec(
            module=SharedAttention,
            params={"attn_mask_type": AttnMaskType.causal, "share": share, "detach_shared": detach_shared},
            submodules=SharedAttentionSubmodules(
                linear_own=input_linear,
                linear_frozen=FrozenProjection,
                core_attention=core_attention,
                linear_proj=output_linear,
            ),
        )
    else:
        attention = ModuleSpec(
            module=ComputingAttention,
            params={
                "attn_mask_type": AttnMaskType.causal,
                "hand_off": share if role == LayerMode.SOURCE else None,
                "detach_shared": detach_shared,
            },
            submodules=SelfAttentionSubmodules(
                linear_qkv=input_linear,
                core_attention=core_attention,
                linear_proj=output_linear,
                q_layernorm=IdentityOp,
                k_layernorm=IdentityOp,
            ),
        )
    if not fused:
        keys_map = {
            "input_layernorm.": "self_attention.linear_qkv.layer_norm_",
            "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_",
        }
    elif role == LayerMode.SHARE:
        own = f"self_attention.linear_{_OWN_PART[share]}."
        keys_map = {own + "layer_norm_": "self_attention.linear_qkv.layer_norm_"}
    else:
        keys_map = {}
    return ModuleSpec(
        module=EpasTransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=norm,
            self_attention=attention,
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=norm,
            mlp=partial(MLP.as_mlp_submodule, submodules=MLPSubmodules(linear_fc1=input_linear, linear_fc2=output_linear)),
            mlp_bda=get_bias_dropout_add,
            sharded_state_dict_keys_map=keys_map,
        ),
    )


def decoder_layer_specs(
    modes: Sequence[LayerMode],
    backend: BackendSpecProvider = LOCAL,
    share: str = "qk",
    detach_shared: bool = False,
) -> list[ModuleSpec]:
    """Specs of all decoder layers of the model, one per mode (global, not yet sliced per
    pipeline stage); the modes come from :func:`epas_megatron.sharing.shape.layer_modes`."""
    return [layer_spec(mode, backend, share, detach_shared) for mode in modes]
