"""Layout-independent initialisation: the same seed gives the same model on any TP/PP/VPP/DP.

Megatron initialises each rank's shards from RNG streams whose position depends on the layout,
so a TP=2 or PP=2 run starts from different weights than one process. Here every parameter is
drawn as its *full, unsharded* tensor from a generator seeded by ``(seed, global parameter
name)`` and each rank keeps its own TP shard. Consequences: runs that differ only in parallel
layout start identical (the parallel-equivalence tests rely on it), and a model built with a
sharing region from the start has exactly the weights of the plain model (the fused QKV is drawn
and then split into the V and frozen Q/K projections), so a fixed-region EPAS model and its
baseline differ only in what they compute.

The draws are made by a CPU generator whatever the model's device (a CUDA generator gives other
numbers), so a GPU run starts from exactly the weights of a CPU run with the same seed; the cost
is about 7 s of CPU time per billion parameters a rank draws (each rank draws the full tensors of
its own layers), once per run.

Scheme (Megatron-LM's defaults for LLaMA): normal(0, std) for embeddings, QKV, SwiGLU fc1 and LM
head; normal(0, std / sqrt(2 * num_layers)) for the attention output projection and fc2; ones
for norm weights.
"""

from __future__ import annotations

import math
import zlib

import torch

from megatron.core import parallel_state

from epas_megatron.model.attention import SharedAttention, fuse_qkv_rows, split_qkv_rows

_SCALED = ("self_attention.linear_proj.weight", "mlp.linear_fc2.weight")


def _generator(seed: int, name: str) -> torch.Generator:
    g = torch.Generator(device="cpu")
    g.manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63 - 1))
    return g


def _full_tensor(name: str, shape, std: float, seed: int) -> torch.Tensor:
    """The full (unsharded) fp32 tensor of a parameter, drawn on CPU (see module doc)."""
    full = torch.empty(shape, dtype=torch.float32)
    full.normal_(0.0, std, generator=_generator(seed, name))
    return full


def _tp_shard(full: torch.Tensor, dim: int) -> torch.Tensor:
    tp = parallel_state.get_tensor_model_parallel_world_size()
    rank = parallel_state.get_tensor_model_parallel_rank()
    return full.chunk(tp, dim=dim)[rank]


def _gated_fc1_shard(full: torch.Tensor) -> torch.Tensor:
    # full [2F, h] = [gate; up]; a TP rank holds [gate_r; up_r] (Megatron's SwiGLU layout).
    gate, up = full.chunk(2, dim=0)
    return torch.cat((_tp_shard(gate, 0), _tp_shard(up, 0)), dim=0)


def _full_shape(param: torch.Tensor) -> tuple[int, ...]:
    shape = list(param.shape)
    if getattr(param, "tensor_model_parallel", False):
        shape[param.partition_dim] *= parallel_state.get_tensor_model_parallel_world_size()
    return tuple(shape)


@torch.no_grad()
def _init_param(param: torch.Tensor, name: str, std: float, seed: int, gated_fc1: bool) -> None:
    if param.dim() == 1:  # norm weights
        param.fill_(1.0)
        return
    full = _full_tensor(name, _full_shape(param), std, seed)
    if gated_fc1 and name.endswith("mlp.linear_fc1.weight"):
        local = _gated_fc1_shard(full)
    elif getattr(param, "tensor_model_parallel", False):
        local = _tp_shard(full, param.partition_dim)
    else:
        local = full
    param.copy_(local.to(param.dtype))


@torch.no_grad()
def _init_shared_attention(attention: SharedAttention, prefix: str, std: float, seed: int) -> None:
    own, frozen = attention.own_projection.weight, attention.frozen_projection.weight
    tp = parallel_state.get_tensor_model_parallel_world_size()
    rows = (own.shape[0] + frozen.shape[0]) * tp
    name = f"{prefix}self_attention.linear_qkv.weight"
    local = _tp_shard(_full_tensor(name, (rows, own.shape[1]), std, seed), 0)
    parts = split_qkv_rows(
        local, ("q", "k", "v"), attention.num_query_groups_per_partition,
        attention._queries_per_group, attention.hidden_size_per_attention_head,
    )
    own.copy_(parts[attention.own_part].to(own.dtype))
    frozen.copy_(fuse_qkv_rows(parts, attention.frozen_parts, attention.num_query_groups_per_partition,
                               attention._queries_per_group, attention.hidden_size_per_attention_head).to(frozen.dtype))


@torch.no_grad()
def initialize_model(model, seed: int, init_std: float, num_layers: int) -> None:
    """Re-initialise every parameter of one (unwrapped) model chunk, layout-independently."""
    scaled_std = init_std / math.sqrt(2.0 * num_layers)
    gated = bool(model.config.gated_linear_unit)
    handled = set()
    for layer in model.decoder.layers:
        prefix = f"decoder.layers.{layer.layer_number - 1}."
        attention = layer.self_attention
        if isinstance(attention, SharedAttention):
            _init_shared_attention(attention, prefix, init_std, seed)
            handled.update(id(p) for p in attention.own_projection.parameters())
            handled.update(id(p) for p in attention.frozen_projection.parameters())
        for name, param in layer.named_parameters():
            if id(param) in handled:
                continue
            std = scaled_std if name in _SCALED else init_std
            _init_param(param, prefix + name, std, seed, gated)
            handled.add(id(param))
    tied = getattr(model, "share_embeddings_and_output_weights", False)
    for name, param in model.named_parameters():
        if id(param) in handled:
            continue
        canonical = "embedding.word_embeddings.weight" if (tied and name == "output_layer.weight") else name
        _init_param(param, canonical, init_std, seed, gated)
        handled.add(id(param))
