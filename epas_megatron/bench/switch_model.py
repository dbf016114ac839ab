"""What one EPAS switch costs at scale, predicted from state sizes and stated bandwidths.

A switch carries the whole training state across a rebuild. Its size, for bf16 training with
the distributed optimizer (Megatron's default at scale), is per parameter: 2 bytes of bf16
weights plus 12 bytes of fp32 main weights and the two Adam moments (the fp32 gradient buffer
is rebuilt, not carried) -- 14 bytes, ~94 GB for LLaMA-7B.

- ``checkpoint``: Megatron's ``fully_reshardable`` format first gathers the distributed
  optimizer's shards over data parallelism into model space (every DP rank receives the
  ``12 x P / (TP x PP)`` bytes of its model-parallel shard, of which it held ``1/DP``); the
  state is written once (``14 x P`` bytes at the file system's aggregate write bandwidth) and
  read back by every rank that needs it -- each data-parallel replica reads its whole
  model-parallel shard, ``14 x P x DP`` bytes at the aggregate read bandwidth.
- ``memory``: no gather. Each rank copies its own part into the new objects (``2 x (2 + 12 /
  DP) x P / (TP x PP)`` bytes through HBM: read and written), the elements whose owner changes
  go point to point -- the layers that change pipeline stage (``14 x`` their parameters
  ``/ TP`` per moved layer, over the inter-stage link) and the switching layer's fused QKV
  optimizer state, assembled on one rank to split off its V rows (``12 x`` its QKV parameters
  ``/ TP``, over the DP link); the shift of the DP shard boundaries by the rows that left the
  buffer is of the same small order and included in that term.

Both rebuild the modules, DDP buffers and optimizer (a stated constant). All bandwidths are
assumptions, given with the result; the CPU measurement of ``epas-bench switch`` checks the
bytes, not these rates.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from epas_megatron.config.presets import decoder_layer_parameters
from epas_megatron.model.architecture import LlamaArchitecture


@dataclass(frozen=True)
class ClusterAssumptions:
    """Rates the prediction assumes (GB/s are 1e9 bytes per second)."""

    gpus_per_node: int = 8
    """GPUs per node."""

    fs_write_gb_s_per_node: float = 2.0
    """Parallel file system write bandwidth per node (the issue's 1-5 GB/s range)."""

    fs_read_gb_s_per_node: float = 4.0
    """Parallel file system read bandwidth per node."""

    intra_node_gb_s: float = 150.0
    """Per-GPU collective / point-to-point bandwidth inside a node (NVLink, effective)."""

    inter_node_gb_s: float = 40.0
    """Per-GPU bandwidth between nodes (400 Gb/s InfiniBand, effective)."""

    hbm_copy_gb_s: float = 1500.0
    """Device-memory copy bandwidth (H100 HBM3, effective for large copies)."""

    rebuild_s: float = 3.0
    """Building modules, DDP buffers and optimizer for the new region (both modes)."""

    mfu: float = 0.40
    """Model FLOPs utilisation of a training iteration (for the cost in iterations)."""

    peak_tflops: float = 989.0
    """Dense bf16 peak per GPU (H100 SXM)."""


def llama_parameters(arch: LlamaArchitecture) -> tuple[int, int]:
    """(total parameters, parameters of one decoder layer) of ``arch``: its layers, the embedding,
    the LM head unless it is tied to the embedding, and the final norm."""
    layer = decoder_layer_parameters(arch.hidden_size, arch.num_attention_heads, arch.num_query_groups, arch.ffn_hidden_size)
    tables = 1 if arch.tie_embeddings else 2
    return arch.num_layers * layer + tables * arch.vocab_size * arch.hidden_size + arch.hidden_size, layer


def predict_switch(params: int, layer_params: int, *, tp: int, pp: int, dp: int, moved_layers: int = 1,
                   qkv_params: int = 0, iteration_flops: float = 0.0, a: ClusterAssumptions = ClusterAssumptions()) -> dict:
    """Seconds (and bytes) of one switch in each mode; ``qkv_params``: the fused QKV weight of
    one layer (whole model, before TP); ``iteration_flops`` (whole model, one iteration) adds
    the cost in iterations."""
    world = tp * pp * dp
    nodes = max(1, -(-world // a.gpus_per_node))
    gb = 1e9
    shard = params / (tp * pp)  # parameters of one model-parallel rank
    dp_link = a.intra_node_gb_s if tp * dp <= a.gpus_per_node else a.inter_node_gb_s
    pp_link = a.intra_node_gb_s if tp * dp * pp <= a.gpus_per_node else a.inter_node_gb_s
    gather = 12 * shard * (dp - 1) / dp
    written = 14 * params
    read = 14 * params * dp
    checkpoint_s = gather / (dp_link * gb) + written / (a.fs_write_gb_s_per_node * nodes * gb) \
        + read / (a.fs_read_gb_s_per_node * nodes * gb) + a.rebuild_s
    local = 2 * (2 + 12 / dp) * shard
    moved = 14 * layer_params / tp * moved_layers if pp > 1 else 0
    assembled = 12 * qkv_params / tp if dp > 1 else 0
    memory_s = local / (a.hbm_copy_gb_s * gb) + moved / (pp_link * gb) + assembled / (dp_link * gb) + a.rebuild_s
    result = {
        "gpus": world, "tp": tp, "pp": pp, "dp": dp, "state_bytes": 14 * params,
        "seconds_checkpoint": checkpoint_s, "seconds_memory": memory_s,
        "bytes_written_checkpoint": written, "bytes_read_checkpoint": read, "bytes_written_memory": 0,
        "bytes_between_ranks_memory": moved * tp + assembled * tp, "gathered_bytes_per_gpu_checkpoint": 12 * shard,
        "gathered_bytes_per_gpu_memory": 0,
    }
    if iteration_flops:
        iteration_s = iteration_flops / (world * a.peak_tflops * 1e12 * a.mfu)
        result.update(iteration_s=iteration_s, iterations_checkpoint=checkpoint_s / iteration_s,
                      iterations_memory=memory_s / iteration_s)
    return result


def assumptions_dict(a: ClusterAssumptions = ClusterAssumptions()) -> dict:
    return asdict(a)
