"""Layer specs: which module fills each slot of a decoder layer, per backend and per EPAS role.

A :class:`Backend` names the classes of one implementation (local pure-PyTorch Megatron-Core
modules, or Transformer Engine). :func:`layer_spec` builds the ``ModuleSpec`` of a layer for a
:class:`~epas_megatron.sharing.shape.LayerMode` -- ``compute``, ``source`` (computing, and
hands its Q/K on) or ``share`` -- from any backend,
so local and TE paths share everything but the classes. Transformer Engine classes are named by
import path (``ModuleSpec(module=(path, name))``): building a TE spec imports nothing, the class is
imported when the layer is built (on a GPU node).

Where a backend fuses the norm into the following GEMM (TE's ``LayerNormColumnParallelLinear``),
the input norm lives in ``linear_qkv`` (computing) or ``linear_v``/``linear_q`` (sharing) and the
layer's ``input_layernorm`` is an identity; the sharded-state-dict key maps make all four
variants save the norm under the same key, ``self_attention.linear_qkv.layer_norm_weight``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial
from typing import Optional, Sequence

from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.transformer.attention import SelfAttentionSubmodules
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
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
from epas_megatron.model.moc import MoCMLP
from epas_megatron.model.moc_sizes import MoCSettings
from epas_megatron.model.norm import RMSNorm
from epas_megatron.model.weight_grad import DelayedWgradColumnParallelLinear, DelayedWgradRowParallelLinear
from epas_megatron.sharing.shape import LayerMode


@dataclass(frozen=True)
class Backend:
    """The module classes of one implementation."""

    name: str
    """'local' or 'transformer_engine'."""

    column_parallel_linear: object
    """Column-parallel GEMM (output features sharded over TP)."""

    row_parallel_linear: object
    """Row-parallel GEMM (input features sharded over TP)."""

    norm_column_parallel_linear: Optional[object]
    """Norm fused into a column-parallel GEMM, or None if the backend does not fuse them."""

    core_attention: object
    """softmax(QK^T)V kernel."""

    norm: object
    """RMSNorm module (used where the norm is not fused)."""


_TE = "megatron.core.extensions.transformer_engine"

LOCAL = Backend(
    name="local",
    column_parallel_linear=DelayedWgradColumnParallelLinear,
    row_parallel_linear=DelayedWgradRowParallelLinear,
    norm_column_parallel_linear=None,
    core_attention=SDPAttention,
    norm=RMSNorm,
)

TRANSFORMER_ENGINE = Backend(
    name="transformer_engine",
    column_parallel_linear=ModuleSpec(module=(_TE, "TEColumnParallelLinear")),
    row_parallel_linear=ModuleSpec(module=(_TE, "TERowParallelLinear")),
    norm_column_parallel_linear=ModuleSpec(module=(_TE, "TELayerNormColumnParallelLinear")),
    core_attention=ModuleSpec(module=(_TE, "TEDotProductAttention")),
    norm=ModuleSpec(module=(_TE, "TENorm")),
)

BACKENDS = {b.name: b for b in (LOCAL, TRANSFORMER_ENGINE)}

# Core attention of local layers per --core-attention (Transformer Engine chooses its own kernel).
_LOCAL_CORE_ATTENTION = {"sdpa": SDPAttention, "unfused": DotProductAttention}
assert set(_LOCAL_CORE_ATTENTION) == set(CORE_ATTENTION_CHOICES)


def get_backend(name: str, core_attention: str = "sdpa") -> Backend:
    """The backend ``name`` ('local' or 'transformer_engine'); for local layers with the core
    attention ``core_attention`` ('sdpa': PyTorch's fused kernels, 'unfused': Megatron-Core's
    ``DotProductAttention``, which materialises the scores)."""
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; expected one of {sorted(BACKENDS)}")
    if core_attention not in _LOCAL_CORE_ATTENTION:
        raise ValueError(f"unknown core attention {core_attention!r}; expected one of {CORE_ATTENTION_CHOICES}")
    backend = BACKENDS[name]
    if name == "local":
        backend = replace(backend, core_attention=_LOCAL_CORE_ATTENTION[core_attention])
    return backend


def layer_spec(mode: LayerMode | str, backend: Backend = LOCAL, share: str = "qk", detach_shared: bool = False,
               moc: Optional[MoCSettings] = None) -> ModuleSpec:
    """The spec of one decoder layer in ``mode`` (a :class:`LayerMode` or its value); ``moc``:
    the Mixture-of-Channels MLP (:class:`~epas_megatron.model.moc_sizes.MoCSettings`) (:mod:`epas_megatron.model.moc`), local
    layers only."""
    try:
        role = LayerMode(mode)
    except ValueError:
        raise ValueError(f"unknown layer mode {mode!r}; expected one of {[str(m) for m in LayerMode]}") from None
    fused = backend.norm_column_parallel_linear is not None
    norm = IdentityOp if fused else backend.norm
    input_linear = backend.norm_column_parallel_linear if fused else backend.column_parallel_linear
    if role == LayerMode.SHARE:
        attention = ModuleSpec(
            module=SharedAttention,
            params={"attn_mask_type": AttnMaskType.causal, "share": share, "detach_shared": detach_shared},
            submodules=SharedAttentionSubmodules(
                linear_own=input_linear,
                linear_frozen=FrozenProjection,
                core_attention=backend.core_attention,
                linear_proj=backend.row_parallel_linear,
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
                core_attention=backend.core_attention,
                linear_proj=backend.row_parallel_linear,
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
            mlp=_mlp(MLPSubmodules(linear_fc1=input_linear, linear_fc2=backend.row_parallel_linear), backend, moc),
            mlp_bda=get_bias_dropout_add,
            sharded_state_dict_keys_map=keys_map,
        ),
    )


def _mlp(submodules: MLPSubmodules, backend: Backend, moc: Optional[MoCSettings]):
    """The ``mlp`` slot: Megatron-Core's MLP, or the Mixture-of-Channels one."""
    if moc is None:
        return partial(MLP.as_mlp_submodule, submodules=submodules)
    if backend.name != "local":
        raise ValueError("Mixture-of-Channels MLPs are built for the local layers only")
    return partial(MoCMLP.as_moc_submodule, submodules=submodules, topk=moc.topk, groups=moc.groups)


def decoder_layer_specs(
    modes: Sequence[LayerMode],
    backend: Backend = LOCAL,
    share: str = "qk",
    detach_shared: bool = False,
    moc: Optional[MoCSettings] = None,
) -> list[ModuleSpec]:
    """Specs of all decoder layers of the model, one per mode (global, not yet sliced per
    pipeline stage); the modes come from :func:`epas_megatron.sharing.shape.layer_modes`."""
    return [layer_spec(mode, backend, share, detach_shared, moc) for mode in modes]
