"""Under torchrun (2 processes, TP=2): what one micro-batch keeps for backward on each rank, without
and with sequence parallelism -- the activation bytes its forward keeps per layer (qk and kv
sharing; one RESULT line per case) and what a split backward's deferred weight-gradient GEMMs
hold from the input-gradient backward ``B`` to ``W`` (dense and Mixture-of-Channels MLPs; one
DEFERRED line per case: the live bytes after ``B``, the storages each GEMM holds, the shape of
the output gradient it keeps, which every deferred GEMM puts last in its holds, and the parameters
whose gradient after ``W`` differs in any bit from the same node's gradient computed at once). The same
launch (a TP=2 world is what it needs) runs an evaluation and a training step on a batch with
masked positions: one TOKENS line with each rank's ``StepResult`` tokens and loss, and the
masked mean of the per-token losses the model returns. Rank 0 prints."""

import contextlib
import json

import torch
import torch.distributed as dist

from epas_megatron.metrics.activation_memory import LiveSavedBytes, measure_saved_bytes
from epas_megatron.model.architecture import LlamaArchitecture
from epas_megatron.model.build_plan import BuildPlan
from epas_megatron.model.builder import build_model
from epas_megatron.model.moc_sizes import MoCSettings
from epas_megatron.model.weight_grad import WEIGHT_GRAD_STORE
from epas_megatron.runtime.distributed import init_distributed

S, B = 48, 2
MOC = (0.25, 4)
"""Mixture-of-Channels MLPs of the deferred case: top quarter of 4 groups (2 per TP rank)."""
MICROBATCHES, MASKED = 2, 5
"""The step case: micro-batches of B sequences, each with its last MASKED positions out of the loss."""


def everyone(value):
    """``value`` of every rank, in rank order."""
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def deferred_bytes(model, tokens):
    """(live bytes right after a split ``B``, the storage bytes each deferred GEMM holds, the shape
    of each one's kept output gradient) of one micro-batch, the weight-gradient store armed as a
    split-backward schedule arms it."""
    tracker = LiveSavedBytes(model.parameters())
    held_by_gemm, grad_output_shapes = [], []
    with tracker.tracking(), WEIGHT_GRAD_STORE.arming():
        hold_all = WEIGHT_GRAD_STORE.on_put

        def recording(holds):  # what each GEMM keeps, by storage, beside the tracker's count
            held_by_gemm.append(sorted(t.untyped_storage().nbytes() for t in holds if t is not None))
            grad_output_shapes.append(list(holds[-1].shape))
            return hold_all(holds)

        WEIGHT_GRAD_STORE.on_put = recording
        loss = model(tokens, torch.arange(S).expand(B, S), None, labels=tokens)
        with WEIGHT_GRAD_STORE.collecting("pass"):
            loss.float().sum().backward()
        held = tracker.current
        ran = WEIGHT_GRAD_STORE.run("pass")
        if tracker.current != 0 or ran != len(held_by_gemm):
            raise AssertionError(f"W left {tracker.current} bytes, ran {ran} of {len(held_by_gemm)} GEMMs")
    return held, held_by_gemm, grad_output_shapes


def gradients(model, tokens, deferred: bool) -> dict[str, torch.Tensor]:
    """Every parameter's gradient of one micro-batch, the store armed: the weight-gradient GEMMs
    deferred to ``W`` (a collecting pass) or computed at once by the same nodes."""
    model.zero_grad(set_to_none=True)
    with WEIGHT_GRAD_STORE.arming():
        loss = model(tokens, torch.arange(S).expand(B, S), None, labels=tokens)
        with WEIGHT_GRAD_STORE.collecting("pass") if deferred else contextlib.nullcontext():
            loss.float().sum().backward()
        WEIGHT_GRAD_STORE.run("pass")
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def deferred_grads_differ(model, tokens) -> list[str]:
    """The parameters whose deferred gradient (gathered again in ``W`` under sequence parallelism)
    is not bit for bit the gradient computed at once."""
    deferred, at_once = gradients(model, tokens, True), gradients(model, tokens, False)
    if deferred.keys() != at_once.keys():
        return sorted(deferred.keys() ^ at_once.keys())
    return [name for name in at_once if not torch.equal(deferred[name], at_once[name])]


def step_batches():
    """The step case's micro-batches (CPU tensors, as the data iterators yield them)."""
    g = torch.Generator().manual_seed(3)
    mask = torch.ones(B, S)
    mask[:, S - MASKED:] = 0
    for _ in range(MICROBATCHES):
        tokens = torch.randint(0, 512, (B, S + 1), generator=g)
        yield {"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "loss_mask": mask, "position_ids": torch.arange(S).expand(B, S)}


def step_tokens(arch):
    """Each rank's (eval_step's tokens and loss, train_step's tokens and loss, the masked mean of
    the model's per-token losses over the same batches)."""
    from epas_megatron.engine.optimizer import OptimizerSettings, build_optimizer, build_scheduler, wrap_ddp
    from epas_megatron.engine.step import eval_step, train_step

    built = build_model(BuildPlan.for_region(arch, (2, 3), seq_length=S, tp=2), seed=1)
    with torch.no_grad():  # the reference: per-token losses [b, s], masked and averaged by hand
        losses = [(built.chunks[0](b["tokens"], b["position_ids"], None, labels=b["labels"]).double() * b["loss_mask"], b["loss_mask"])
                  for b in step_batches()]
    reference = sum(loss.sum() for loss, _ in losses).item() / sum(mask.sum() for _, mask in losses).item()
    run = dict(num_microbatches=MICROBATCHES, seq_length=built.schedule_seq_length, micro_batch_size=B)
    evaluated = eval_step(built.chunks, [step_batches()], **run)
    settings = OptimizerSettings(lr=1e-3, min_lr=1e-3, weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8,
                                 clip_grad=0.0, use_distributed_optimizer=False, overlap_grad_reduce=False,
                                 warmup_iters=0, decay_iters=10, decay_style="constant")
    model = wrap_ddp(built.chunks, built.config, settings)
    optimizer = build_optimizer(model, settings)
    trained = train_step(model, optimizer, build_scheduler(optimizer, settings), [step_batches()], **run)
    return {"eval_tokens": evaluated.tokens, "eval_loss": evaluated.lm_loss, "train_tokens": trained.tokens,
            "train_loss": trained.lm_loss, "reference_loss": reference}


def main():
    init_distributed(2, 1, None, seed=1)
    shape = dict(num_layers=4, hidden_size=128, num_attention_heads=8, num_query_groups=2, ffn_hidden_size=352,
                 vocab_size=512, max_sequence_length=S)
    arch = LlamaArchitecture(**shape)
    tokens = torch.randint(0, 512, (B, S), generator=torch.Generator().manual_seed(0))
    for sequence_parallel in (False, True):
        for share in ("qk", "kv"):
            plan = BuildPlan.for_region(arch, (2, 3), seq_length=S, tp=2, sequence_parallel=sequence_parallel, share=share)
            model = build_model(plan, seed=1).chunks[0]
            got = measure_saved_bytes(model, tokens, torch.arange(S).expand(B, S), None, labels=tokens)
            layers = everyone(got.layers)
            if dist.get_rank() == 0:
                print("RESULT " + json.dumps({"sequence_parallel": sequence_parallel, "share": share,
                                              "layers_per_rank": [{str(k): v for k, v in r.items()} for r in layers]}), flush=True)
            if share == "kv":
                continue
            for moc in (None, MOC):  # the qk model's split backward, its MLPs dense and Mixture-of-Channels
                if moc is not None:
                    plan = BuildPlan.for_region(arch, (2, 3), seq_length=S, tp=2, sequence_parallel=sequence_parallel,
                                                options=(MoCSettings(*MOC),))
                    model = build_model(plan, seed=1).chunks[0]
                held, by_gemm, grad_outputs = (everyone(value) for value in deferred_bytes(model, tokens))
                differ = everyone(deferred_grads_differ(model, tokens))
                if dist.get_rank() == 0:
                    print("DEFERRED " + json.dumps({"sequence_parallel": sequence_parallel, "share": share, "moc": moc,
                                                    "held_per_rank": held, "gemms_per_rank": by_gemm,
                                                    "grad_output_shapes_per_rank": grad_outputs,
                                                    "grads_differ_per_rank": differ}), flush=True)
    steps = everyone(step_tokens(arch))
    if dist.get_rank() == 0:
        print("TOKENS " + json.dumps({"per_rank": steps, "microbatches": MICROBATCHES, "masked": MASKED}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
