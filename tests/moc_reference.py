"""An independent reference of the Mixture-of-Channels Top-K rule, and MLP weights that plant ties
at the Top-K boundary.

The rule (``epas_megatron.hf.moc_topk``): per group, the ``k`` largest values, equal values to
the lower channel index. Here it is a plain Python loop that sorts each group's channels by
``(-value, index)``; :func:`higher_index_channels` is the same loop with the other tie-break (the
negative control: on a tie at the boundary it keeps other channels).

The planted weights make the gate pre-activation ``G = x W_gate^T`` exact in any precision and any
summation order: ``x`` and ``W_gate`` hold -1, 0 and 1, so ``G`` holds small integers (exact in
bf16 up to 256), and equal values are equal bits on every path, shape and tensor-parallel
degree. A group of 12 such integers ties at the boundary often (about half the (token, group)
pairs here); and one token per batch, ``e_0``, reads ``W_gate``'s column 0, planted so that in
every group channels 3, 7 and 9 hold 2, the last ``k - 2`` channels 5 and the rest at most 1:
three channels tie for the last two places (3 and 7 are kept, 9 is not).
"""

import torch
import torch.nn.functional as F


def reference_channels(values: torch.Tensor, k: int) -> torch.Tensor:
    """``[..., c]`` -> ``[..., k]``: per group the channels sorted by (-value, index), the first ``k``."""
    rows = values.detach().double().reshape(-1, values.shape[-1]).tolist()
    kept = [sorted(range(len(row)), key=lambda i: (-row[i], i))[:k] for row in rows]
    return torch.tensor(kept, dtype=torch.long).reshape(*values.shape[:-1], k)


def higher_index_channels(values: torch.Tensor, k: int) -> torch.Tensor:
    """The negative control: per group the channels sorted by (-value, -index), the first ``k``."""
    rows = values.detach().double().reshape(-1, values.shape[-1]).tolist()
    kept = [sorted(range(len(row)), key=lambda i: (-row[i], -i))[:k] for row in rows]
    return torch.tensor(kept, dtype=torch.long).reshape(*values.shape[:-1], k)


def planted_kept(c: int, k: int) -> list[int]:
    """The channels the rule keeps, ranked, in every group of the planted token ``e_0``."""
    return [*range(c - (k - 2), c), 3, 7]


def planted_weights(hidden: int, ffn: int, groups: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """fp64 ``fc1`` ``[2 ffn, hidden]`` (``[W_gate; W_up]``, Megatron's ``linear_fc1`` layout) and
    ``fc2`` ``[hidden, ffn]``; ``W_gate`` as the module notes say, ``W_up`` and ``W_down`` normal."""
    c = ffn // groups
    assert k >= 2 and c >= k + 8, "the planted column needs channels 3, 7, 9 below the k - 2 high ones"
    g = torch.Generator().manual_seed(seed)
    gate = torch.randint(-1, 2, (ffn, hidden), generator=g).double()
    column = gate[:, 0].reshape(groups, c).clone()  # [groups, c]
    column[:, [3, 7, 9]] = 2.0
    column[:, c - (k - 2):] = 5.0
    gate[:, 0] = column.flatten()
    up = torch.randn(ffn, hidden, generator=g, dtype=torch.float64) * 0.5
    down = torch.randn(hidden, ffn, generator=g, dtype=torch.float64) * 0.2
    return torch.cat([gate, up]), down


def planted_inputs(shape: tuple[int, ...], hidden: int, seed: int = 1) -> torch.Tensor:
    """fp64 ``[*shape, hidden]`` in {-1, 0, 1}; the first token is ``e_0`` (the planted ties)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-1, 2, (*shape, hidden), generator=g).double()
    first = x.view(-1, hidden)[0]
    first.zero_()
    first[0] = 1.0
    return x


def gate_groups(x: torch.Tensor, fc1: torch.Tensor, groups: int) -> torch.Tensor:
    """``G`` in fp64, ``[..., hidden]`` -> ``[..., groups, c]``."""
    gate = (x.double() @ fc1.double().t()).chunk(2, dim=-1)[0]
    return gate.unflatten(-1, (groups, -1))


def boundary_ties(values: torch.Tensor, k: int) -> float:
    """The fraction of groups whose ``k``-th and ``(k + 1)``-th largest values are equal."""
    ranked = values.sort(dim=-1, descending=True).values
    return (ranked[..., k - 1] == ranked[..., k]).double().mean().item()


ATOL = {torch.float32: 1e-6, torch.bfloat16: 2e-2}
"""Absolute tolerance of an MLP's output against :func:`masked_swiglu`, relative to the output's
largest magnitude (the planted gates reach a few tens); the control rule's output differs from
the reference's by more than 0.2 of it here."""


def assert_close_to_reference(actual: torch.Tensor, reference: torch.Tensor, dtype: torch.dtype) -> None:
    """``actual`` equals ``reference`` within :data:`ATOL` of the largest magnitude (rtol 1e-5 fp32,
    2e-2 bf16)."""
    scale = reference.abs().max().item()
    rtol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(actual.double(), reference.double(), rtol=rtol, atol=ATOL[dtype] * scale)


def masked_swiglu(x, fc1, fc2, groups: int, k: int, rule=reference_channels) -> torch.Tensor:
    """Plain PyTorch in fp64: ``G, U = x W1^T``; the mask keeps ``rule``'s channels of each group;
    ``(SiLU(G) * U * M) W2^T``."""
    x, fc1, fc2 = x.double(), fc1.double(), fc2.double()
    gate, up = (x @ fc1.t()).chunk(2, dim=-1)
    grouped = gate.unflatten(-1, (groups, -1))  # [..., groups, c]
    mask = torch.zeros_like(grouped).scatter_(-1, rule(grouped, k), 1.0).flatten(-2)
    return (F.silu(gate) * up * mask) @ fc2.t()


def forward_keeping(mlp, x):
    """(The MLP's output, the channel indices its forward saves for backward: the only integer
    tensor autograd's saved-tensor hooks see)."""
    saved = []

    def pack(tensor):
        if not tensor.is_floating_point():
            saved.append(tensor)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = mlp(x.detach().clone().requires_grad_())[0]
    (index,) = saved
    return out.detach(), index.long()
