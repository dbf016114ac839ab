"""Self-attention in the two EPAS modes, as siblings of Megatron-Core's ``SelfAttention``.

* :class:`ComputingAttention` is Megatron-Core's ``SelfAttention`` (its own fused ``linear_qkv``).
  When it is the *source* of a sharing region (the last computing layer before it) it also hands
  its post-RoPE Q and K (``share='qk'``) or K and V (``share='kv'``) on, through
  :meth:`ComputingAttention.forward_and_hand_off`; otherwise the stock forward runs. A subclass
  may change the pair it hands on (:meth:`ComputingAttention.before_hand_off`: the switch ramp's
  blending, :mod:`epas_megatron.model.blending`).
* :class:`SharedAttention` is a layer in *sharing mode*: it projects only its own part (V for
  ``'qk'``, Q for ``'kv'``) with a TP-sharded ``linear_v`` / ``linear_q`` whose rows are exactly
  the V (Q) rows of the fused QKV it replaces, takes the other two from the hand-off, and runs
  the same ``core_attention`` and ``linear_proj``. The Q/K (K/V) rows of the fused QKV stay in the
  module as a frozen ``linear_qk`` (``linear_kv``, a :class:`FrozenProjection`): never used in the
  forward, never given to the optimizer, kept so that the checkpoint can run with a smaller region.
  It is a plain TP-sharded weight holder on every backend -- a GEMM module that never runs would
  only add what a running GEMM needs (Transformer Engine's FP8 ``_extra_state``, a userbuffer
  name for TP-communication overlap, a gradient-accumulation-fusion hook).

Checkpoint format (both modes, both backends): the fused QKV is stored as three tensors per layer,
``self_attention.linear_q.weight`` ``[np*hn, h]``, ``linear_k.weight`` and ``linear_v.weight``
``[ng*hn, h]`` (TP-sharded along rows), through ``ShardedTensorFactory``. A computing layer
splits its fused weight on save and fuses on load; a sharing layer saves its trainable part under
its own key and its frozen part under the other two. Optimizer state follows the same factories,
so switching a layer to sharing (save, rebuild, load) carries the Adam moments of its V rows over
exactly, and a checkpoint of any region loads into a model of any region.

GQA: K keeps the source's KV heads; the V of a sharing layer has the same KV heads. Requires
``num_query_groups % tp == 0`` (each TP rank holds whole groups).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.transformer.attention import Attention, SelfAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint
from megatron.core.typed_torch import apply_module

SHARE_MODES = ("qk", "kv")

# Per KV group, the fused QKV weight holds [q_1 .. q_{np/ng}, k, v] head blocks of hn rows.
# own part (trainable in a sharing layer) and frozen parts, per share mode:
_OWN_PART = {"qk": "v", "kv": "q"}
_FROZEN_PARTS = {"qk": ("q", "k"), "kv": ("k", "v")}


def _rope_pair(rotary_pos_emb):
    if rotary_pos_emb is None or isinstance(rotary_pos_emb, tuple):
        return rotary_pos_emb
    return (rotary_pos_emb, rotary_pos_emb)


class _AttentionOps:
    """What computing (as a source) and sharing attention do the same way."""

    def _rope(self, tensor: Tensor, pos_emb: Optional[Tensor]) -> Tensor:
        if pos_emb is None:
            return tensor
        return apply_rotary_pos_emb(
            tensor,
            pos_emb,
            config=self.config,
            cu_seqlens=None,
            mscale=self._yarn_concentration_factor,
            cp_group=self.pg_collection.cp,
        )

    def _attend_and_project(self, query, key, value, attention_mask, attention_bias, packed_seq_params):
        # query [sq, b, np, hn], key/value [sk, b, ng, hn] -> context [sq, b, np * hn]
        # Selective recompute (core_attn) re-runs the same kernel from the same inputs.
        attend = (
            self._checkpointed_attention_forward
            if self.checkpoint_core_attention and self.training
            else apply_module(self.core_attention)
        )
        context = attend(
            query,
            key,
            value,
            attention_mask,
            attn_mask_type=self.attn_mask_type,
            attention_bias=attention_bias,
            packed_seq_params=packed_seq_params,
        )
        # [sq, b, np * hn] -> [sq, b, h]
        return apply_module(self.linear_proj)(context)

    @property
    def _heads(self) -> dict[str, int]:
        """Local (this TP rank) head counts of q, k and v."""
        return {
            "q": self.num_attention_heads_per_partition,
            "k": self.num_query_groups_per_partition,
            "v": self.num_query_groups_per_partition,
        }


def _part_rows_per_group(queries_per_group: int) -> dict[str, int]:
    return {"q": queries_per_group, "k": 1, "v": 1}


def split_qkv_rows(rows_tensor: Tensor, order: tuple[str, ...], num_groups: int, queries_per_group: int,
                   head_dim: int) -> dict[str, Tensor]:
    """Rows holding, per KV group, the parts in ``order`` (a sub-sequence of q, k, v) -> one
    contiguous tensor per part: q ``[groups*np/ng*hn, h]``, k and v ``[groups*hn, h]``."""
    rows = _part_rows_per_group(queries_per_group)
    hidden = rows_tensor.shape[-1]
    # [groups * rows_per_group, h] -> [groups, rows_per_group, h]
    grouped = rows_tensor.view(num_groups, -1, hidden)
    pieces = torch.split(grouped, [rows[p] * head_dim for p in order], dim=1)
    # [groups, rows_p, h] -> [groups * rows_p, h]
    return {p: t.reshape(-1, hidden) for p, t in zip(order, pieces)}


def fuse_qkv_rows(parts: dict[str, Tensor], order: tuple[str, ...], num_groups: int, queries_per_group: int, head_dim: int) -> Tensor:
    """Inverse of :func:`split_qkv_rows`."""
    rows = _part_rows_per_group(queries_per_group)
    hidden = parts[order[0]].shape[-1]
    grouped = [parts[p].reshape(num_groups, rows[p] * head_dim, hidden) for p in order]
    return torch.cat(grouped, dim=1).reshape(-1, hidden)


def _rename_prefix(state_dict: dict, old: str, new: str) -> None:
    """Move every entry of ``state_dict`` under ``old`` to the same name under ``new``."""
    for key in [k for k in state_dict if k.startswith(old)]:
        state_dict[new + key[len(old):]] = state_dict.pop(key)


def qkv_split_factory(
    original: ShardedTensor,
    fused_key_suffix: str,
    parts: tuple[str, ...],
    queries_per_group: int,
    head_dim: int,
    sharded_offsets: tuple,
) -> ShardedTensorFactory:
    """Save a tensor holding ``parts`` of the fused QKV rows (per KV group, in q/k/v order) as
    one TP-sharded tensor per part, ``...linear_<part>.weight``; fuse them back on load.

    ``original`` is the default ShardedTensor of the tensor (TP-sharded along rows);
    ``fused_key_suffix`` is the tail of its key that is replaced by ``linear_<part>.weight``.
    Works for model weights and, through Megatron's optimizer factories, for Adam moments.
    """
    rows = _part_rows_per_group(queries_per_group)
    prepend = len(sharded_offsets)
    tp_axis = prepend
    local_rows = original.local_shape[0]
    tp_size = original.axis_fragmentations[tp_axis]
    tp_rank = original.global_offset[tp_axis] // local_rows
    rows_per_group = sum(rows[p] for p in parts) * head_dim
    assert local_rows % rows_per_group == 0, (original.key, local_rows, rows_per_group)
    local_groups = local_rows // rows_per_group

    def key_of(key: str, part: str) -> str:
        assert key.endswith(fused_key_suffix), (key, fused_key_suffix)
        return f"{key[: -len(fused_key_suffix)]}linear_{part}.weight"

    @torch.no_grad()
    def build(key: str, data: Tensor, replica_id, flattened_range):
        assert flattened_range is None, "flattened optimizer states are not supported here"
        pieces = split_qkv_rows(data, parts, local_groups, queries_per_group, head_dim)
        return {
            part: ShardedTensor.from_rank_offsets(
                key_of(key, part),
                pieces[part],
                *sharded_offsets,
                (tp_axis, tp_rank, tp_size),
                replica_id=replica_id,
                prepend_axis_num=prepend,
            )
            for part in parts
        }

    @torch.no_grad()
    def merge(loaded: dict[str, Tensor]) -> Tensor:
        return fuse_qkv_rows(loaded, parts, local_groups, queries_per_group, head_dim)

    return ShardedTensorFactory(original.key, original.data, build, merge, original.replica_id)


class ComputingAttention(_AttentionOps, SelfAttention):
    """Megatron-Core ``SelfAttention`` that can act as the source of a sharing region."""

    def __init__(self, *args, hand_off: Optional[str] = None, detach_shared: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        if hand_off is not None and hand_off not in SHARE_MODES:
            raise ValueError(f"hand_off must be one of {SHARE_MODES} or None, got {hand_off!r}")
        self.hand_off = hand_off
        """None, or what this layer hands on to the sharing region after it ('qk' or 'kv')."""
        self.detach_shared = detach_shared

    def before_hand_off(self, query: Tensor, key: Tensor, value: Tensor,
                        incoming: Optional[tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor, Tensor]:
        """The post-RoPE ``query``, ``key``, ``value`` (``[s, b, heads, hn]``) this layer attends
        with and hands on, given the hand-off ``incoming`` to it (None: none enters): its own."""
        return query, key, value

    def forward_and_hand_off(
        self,
        hidden_states: Tensor,
        attention_mask: Optional[Tensor],
        rotary_pos_emb=None,
        attention_bias: Optional[Tensor] = None,
        packed_seq_params=None,
        kept_index: Optional[Tensor] = None,
        incoming: Optional[tuple[Tensor, Tensor]] = None,
    ) -> tuple[tuple[Tensor, Optional[Tensor]], tuple[Tensor, Tensor]]:
        """Attention output and bias, plus the hand-off: post-RoPE (Q, K), or (K, V).

        ``kept_index`` (Random-LTD, ``[b, r]``): Q, K and V are computed for every token (the
        hand-off covers the whole sequence) and the layer's own attention runs on the kept
        tokens only: the output is ``[r, b, h]``. ``incoming``: the hand-off entering the layer
        (read by :meth:`before_hand_off` only)."""
        assert self.hand_off is not None
        # [sq, b, h] -> [sq, b, np, hn], [sq, b, ng, hn], [sq, b, ng, hn]
        query, key, value = self.get_query_key_value_tensors(hidden_states)
        pos = _rope_pair(rotary_pos_emb)
        if pos is not None:
            query = self._rope(query, pos[0])
            key = self._rope(key, pos[1])
        query, key, value = self.before_hand_off(query, key, value, incoming)
        # The hand-off is these very tensors: no copy, the sharing layers read them as they are.
        shared = (query, key) if self.hand_off == "qk" else (key, value)
        if kept_index is not None:
            from epas_megatron.random_ltd.tokens import gather_rows

            # [sq, b, heads, hn] -> [r, b, heads, hn]
            query, key, value = (gather_rows(t, kept_index) for t in (query, key, value))
        output = self._attend_and_project(query, key, value, attention_mask, attention_bias, packed_seq_params)
        return output, tuple(t.detach() for t in shared) if self.detach_shared else shared

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # A plain (non-sharded) state dict of a sharing layer holds its own and frozen rows
        # (linear_v + linear_qk, or linear_q + linear_kv): fuse them back into linear_qkv, the
        # inverse of SharedAttention's conversion, so plain state dicts load into any region in
        # both directions (evaluation at a smaller region than the one training).
        for share, own in _OWN_PART.items():
            own_key = f"{prefix}linear_{own}.weight"
            frozen_key = f"{prefix}linear_{''.join(_FROZEN_PARTS[share])}.weight"
            if own_key in state_dict and frozen_key in state_dict:
                groups, hn = self.num_query_groups_per_partition, self.hidden_size_per_attention_head
                qpg = self.num_attention_heads_per_partition // groups
                parts = split_qkv_rows(state_dict.pop(frozen_key), _FROZEN_PARTS[share], groups, qpg, hn)
                parts[own] = state_dict.pop(own_key)
                state_dict[f"{prefix}linear_qkv.weight"] = fuse_qkv_rows(parts, ("q", "k", "v"), groups, qpg, hn)
                # The rest of the running GEMM (TE's fused norm weight, FP8 extra state) is the fused one's.
                _rename_prefix(state_dict, f"{prefix}linear_{own}.", f"{prefix}linear_qkv.")
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata=None):
        state = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        key = f"{prefix}linear_qkv.weight"
        state[key] = qkv_split_factory(
            state[key],
            "linear_qkv.weight",
            ("q", "k", "v"),
            self.num_attention_heads_per_partition // self.num_query_groups_per_partition,
            self.hidden_size_per_attention_head,
            sharded_offsets,
        )
        return state


class FrozenProjection(torch.nn.Module):
    """The frozen rows of a sharing layer's former fused QKV: ``weight [out / tp, in]``, sharded
    over TP along rows like a column-parallel GEMM, ``requires_grad=False``, never run."""

    def __init__(self, input_size: int, output_size: int, *, config, tp_group, name: Optional[str] = None, **unused):
        super().__init__()
        tp = tp_group.size()
        if output_size % tp:
            raise ValueError(f"frozen projection rows {output_size} are not divisible by TP {tp}")
        device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
        weight = torch.empty(output_size // tp, input_size, dtype=config.params_dtype, device=device)
        self.weight = torch.nn.Parameter(weight, requires_grad=False)
        set_tensor_model_parallel_attributes(self.weight, is_parallel=True, dim=0, stride=1)
        self.tp_group = tp_group

    def forward(self, *args, **kwargs):
        raise RuntimeError("a sharing layer's frozen Q/K (K/V) projection is kept for other regions, never run")

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata=None):
        """The weight as a ShardedTensor, TP-sharded along rows (as ColumnParallelLinear's)."""
        return make_sharded_tensors_for_checkpoint(
            {"weight": self.weight}, prefix, {"weight": 0}, sharded_offsets, tp_group=self.tp_group,
            dp_cp_group=_dp_cp_group(),
        )


def _dp_cp_group():
    from megatron.core import parallel_state

    return parallel_state.get_data_parallel_group(with_context_parallel=True)


@dataclass
class SharedAttentionSubmodules:
    """Submodules of a sharing layer's attention (names as in ``SelfAttentionSubmodules``)."""

    linear_own: object
    """Trainable projection of the layer's own part (V for 'qk', Q for 'kv'); TP column-parallel,
    LayerNorm-fused where the backend fuses norm and GEMM."""

    linear_frozen: object
    """The frozen remainder of the fused QKV (Q|K for 'qk', K|V for 'kv'):
    :class:`FrozenProjection` on every backend."""

    core_attention: object
    """Same core attention as the computing layers."""

    linear_proj: object
    """Same row-parallel output projection as the computing layers."""


class SharedAttention(_AttentionOps, Attention):
    """Attention of a layer in sharing mode: ``attention(Q_src, K_src, V_own)`` (``'qk'``) or
    ``attention(Q_own, K_src, V_src)`` (``'kv'``), then its own output projection."""

    def __init__(
        self,
        config,
        submodules: SharedAttentionSubmodules,
        layer_number: int,
        attn_mask_type: AttnMaskType = AttnMaskType.padding,
        share: str = "qk",
        detach_shared: bool = False,
        cp_comm_type: Optional[str] = None,
        pg_collection=None,
        pp_layer_offset: Optional[int] = None,
        name: Optional[str] = None,
    ):
        if share not in SHARE_MODES:
            raise ValueError(f"share must be one of {SHARE_MODES}, got {share!r}")
        super().__init__(
            config=config,
            submodules=submodules,
            layer_number=layer_number,
            attn_mask_type=attn_mask_type,
            attention_type="self",
            cp_comm_type=cp_comm_type,
            pg_collection=pg_collection,
            pp_layer_offset=pp_layer_offset,
            name=name,
        )
        if config.num_query_groups % self.world_size:
            raise ValueError(
                f"QK sharing needs whole KV groups per TP rank: num_query_groups "
                f"{config.num_query_groups} is not divisible by TP {self.world_size}"
            )
        self.share = share
        self.detach_shared = detach_shared
        self.own_part = _OWN_PART[share]
        self.frozen_parts = _FROZEN_PARTS[share]
        sizes = {
            "q": self.query_projection_size,
            "k": self.kv_projection_size,
            "v": self.kv_projection_size,
        }

        own_name = f"linear_{self.own_part}"
        frozen_name = "linear_" + "".join(self.frozen_parts)
        # The own GEMM takes the fused QKV's place, including its TP-overlap userbuffer ('qkv').
        own = submodules.linear_own(
            self.config.hidden_size,
            sizes[self.own_part],
            config=self.config,
            init_method=self.config.init_method,
            gather_output=False,
            bias=self.config.add_bias_linear or self.config.add_qkv_bias,
            skip_bias_add=False,
            is_expert=False,
            tp_comm_buffer_name="qkv",
            tp_group=self.pg_collection.tp,
            name=(name + f".{own_name}") if name is not None else None,
        )
        frozen = submodules.linear_frozen(
            self.config.hidden_size,
            sum(sizes[p] for p in self.frozen_parts),
            config=self.config,
            tp_group=self.pg_collection.tp,
        )
        if self.config.add_bias_linear or self.config.add_qkv_bias:
            raise ValueError("QK sharing supports bias-free QKV projections only (LLaMA); got add_qkv_bias/add_bias_linear")
        setattr(self, own_name, own)
        setattr(self, frozen_name, frozen)
        self._own_name, self._frozen_name = own_name, frozen_name

    @property
    def own_projection(self):
        """The trainable projection (``linear_v`` or ``linear_q``)."""
        return getattr(self, self._own_name)

    @property
    def frozen_projection(self):
        """The frozen projection (``linear_qk`` or ``linear_kv``)."""
        return getattr(self, self._frozen_name)

    def get_query_key_value_tensors(self, hidden_states, key_value_states=None, output_gate=False, split_qkv=True):
        raise NotImplementedError("a sharing layer takes its Q/K from the hand-off; use forward()")

    def forward(
        self,
        hidden_states: Tensor,
        attention_mask: Optional[Tensor],
        shared: tuple[Tensor, Tensor],
        rotary_pos_emb=None,
        attention_bias: Optional[Tensor] = None,
        packed_seq_params=None,
    ) -> tuple[tuple[Tensor, Optional[Tensor]], tuple[Tensor, Tensor]]:
        """Attention output and bias, and the hand-off passed on unchanged."""
        if shared is None:
            raise RuntimeError(
                f"layer {self.layer_number} is in sharing mode but received no Q/K hand-off: "
                "the layer before it is neither a source nor a sharing layer"
            )
        first, second = (t.detach() for t in shared) if self.detach_shared else shared
        # [sq, b, h] -> [sq, b, own heads * hn]
        own, _ = apply_module(self.own_projection)(hidden_states)
        heads = self._heads[self.own_part]
        # [sq, b, own heads * hn] -> [sq, b, own heads, hn]
        own = own.view(own.size(0), own.size(1), heads, self.hidden_size_per_attention_head)
        if self.share == "qk":
            query, key, value = first, second, own
        else:
            pos = _rope_pair(rotary_pos_emb)
            query = self._rope(own, pos[0]) if pos is not None else own
            key, value = first, second
        output = self._attend_and_project(query, key, value, attention_mask, attention_bias, packed_seq_params)
        return output, shared

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # A plain (non-sharded) state dict of a computing layer holds the fused linear_qkv: take
        # this layer's own and frozen rows from it, so plain state dicts load into any region.
        fused_key = f"{prefix}linear_qkv.weight"
        if fused_key in state_dict:
            fused = state_dict.pop(fused_key)
            # The rest of the fused GEMM (TE's fused norm weight, FP8 extra state) belongs to the
            # GEMM that runs.
            _rename_prefix(state_dict, f"{prefix}linear_qkv.", f"{prefix}{self._own_name}.")
            groups, qpg, hn = self.num_query_groups_per_partition, self._queries_per_group, self.hidden_size_per_attention_head
            parts = split_qkv_rows(fused, ("q", "k", "v"), groups, qpg, hn)
            state_dict[f"{prefix}{self._own_name}.weight"] = parts[self.own_part]
            state_dict[f"{prefix}{self._frozen_name}.weight"] = fuse_qkv_rows(parts, self.frozen_parts, groups, qpg, hn)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    @property
    def _queries_per_group(self) -> int:
        return self.num_attention_heads_per_partition // self.num_query_groups_per_partition

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata=None):
        state = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        frozen_key = f"{prefix}{self._frozen_name}.weight"
        # The frozen rows are saved under the canonical per-part keys (linear_q/k/v.weight).
        state[frozen_key] = qkv_split_factory(
            state[frozen_key],
            f"{self._frozen_name}.weight",
            self.frozen_parts,
            self._queries_per_group,
            self.hidden_size_per_attention_head,
            sharded_offsets,
        )
        # `_extra_state` (FP8 metadata under Transformer Engine, empty otherwise): the own GEMM's
        # is saved under the computing layer's key (the frozen projection has none).
        own_extra = state.get(f"{prefix}{self._own_name}._extra_state")
        if own_extra is not None:
            own_extra.key = own_extra.key.replace(f"{self._own_name}._extra_state", "linear_qkv._extra_state")
        return state
