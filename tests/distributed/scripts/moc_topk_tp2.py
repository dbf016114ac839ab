"""Under torchrun (2 processes, TP=2): a Mixture-of-Channels MLP (hidden 16, ffn 48 in 4 groups of
12, 3 kept) on the planted-tie weights and inputs the test saved (``DIR/planted.pt``, full fp64
tensors; tests/moc_reference.py), in fp32 and bf16, without and with sequence parallelism. Each
rank saves ``DIR/rank{r}.pt``: per case the channel indices its forward keeps for backward
(``[s, b, 2, 3]``: its two groups) and the MLP's full output (``[s, b, h]``, gathered along the
sequence under sequence parallelism). tests/model/test_moc_topk.py compares them with TP=1."""

import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.core import parallel_state
from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig

from epas_megatron.model.moc import MoCMLP
from epas_megatron.model.weight_grad import DelayedWgradColumnParallelLinear, DelayedWgradRowParallelLinear
from epas_megatron.runtime.distributed import init_distributed

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/: the shared helper

from moc_reference import forward_keeping  # noqa: E402

TP, GROUPS, TOPK = 2, 4, 0.25


def main(folder: Path):
    init_distributed(TP, 1, None, seed=1)
    rank = dist.get_rank()
    planted = torch.load(folder / "planted.pt")
    x, fc1, fc2 = planted["x"], planted["fc1"], planted["fc2"]
    hidden, ffn = fc2.shape
    shard = slice(rank * ffn // TP, (rank + 1) * ffn // TP)  # this rank's gate (and up) channels
    gate, up = fc1.chunk(2)
    local_fc1 = torch.cat([gate[shard], up[shard]])  # [2 f/tp, h]: Megatron's SwiGLU shard
    local_fc2 = fc2[:, shard]  # [h, f/tp]
    submodules = MLPSubmodules(linear_fc1=DelayedWgradColumnParallelLinear, linear_fc2=DelayedWgradRowParallelLinear)
    results = {}
    for dtype in (torch.float32, torch.bfloat16):
        for sequence_parallel in (False, True):
            config = TransformerConfig(num_layers=1, hidden_size=hidden, num_attention_heads=2, ffn_hidden_size=ffn,
                                       gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False, params_dtype=dtype,
                                       use_cpu_initialization=True, bias_activation_fusion=False, tensor_model_parallel_size=TP,
                                       sequence_parallel=sequence_parallel)
            mlp = MoCMLP(config=config, submodules=submodules, topk=TOPK, groups=GROUPS,
                         tp_group=parallel_state.get_tensor_model_parallel_group())
            with torch.no_grad():
                mlp.linear_fc1.weight.copy_(local_fc1)
                mlp.linear_fc2.weight.copy_(local_fc2)
            inputs = x.to(dtype)  # [s, b, h]
            if sequence_parallel:
                inputs = inputs.chunk(TP, dim=0)[rank]  # [s/tp, b, h]
            out, kept = forward_keeping(mlp, inputs)
            out = out.float()
            if sequence_parallel:
                parts = [torch.empty_like(out) for _ in range(TP)]
                dist.all_gather(parts, out)
                out = torch.cat(parts)  # [s, b, h]
            results[f"{dtype}-sp{int(sequence_parallel)}"] = {"kept": kept, "out": out}
    torch.save(results, folder / f"rank{rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
