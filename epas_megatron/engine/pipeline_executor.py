"""Run a pipeline schedule's action lists (:mod:`epas_megatron.parallel.pipeline_schedule`) on this
rank's model chunks: the one runtime for schedules Megatron-Core does not have.

Why not ``torch.distributed.pipelining`` (whose runtime takes custom action lists): its weight
gradient step writes ``weight.grad`` through ``autograd.grad``, past Megatron DDP's ``main_grad``
hooks, and its stages exchange plain activations, not the EPAS hand-off rows the project's
blocks pack into the p2p tensor. So the lists run here on the project's own pieces:

* each forward and backward is Megatron-Core's own ``schedules.forward_step`` /
  ``backward_step`` -- the same loss function and per-token loss accounting, loss scaling
  (``config.grad_scale_func``), ``set_input_tensor`` and ``retain_grad`` as its 1F1B;
* a tensor between ranks goes point to point on the pipeline group, as
  :mod:`epas_megatron.parallel.pipeline_p2p` plans it: between two passes, the sends of the pass
  before and the receives of the pass after (in the order each peer sends) go out as one
  ``batch_isend_irecv``; the rank waits for it when it receives, or when it would leave more than
  one send pending, and drops a send's ``Work`` (which holds the sent tensor) once it has
  completed. The order is the same on every backend and is checked under NCCL's rules (by the
  pure check, and in processes by :mod:`epas_megatron.compat.nccl_rules`); each message also
  carries a tag of its own, which gloo pairs by and NCCL ignores. The activation p2p tensor is
  ``[rows, b, h]`` with the hand-off rows the blocks pack (``schedule_seq_length``), exactly what
  Megatron's schedules exchange; a stage boundary inside a rank (V placement's turn) hands the
  output on without a copy, as a new leaf;
* gradient reduction: Megatron DDP's ``no_sync`` for the whole iteration, then
  ``config.finalize_model_grads_func`` with the iteration's token count (the data-parallel
  all-reduce, the embedding group's, the per-token division) -- what Megatron's schedules end
  with.

* the weight-gradient split (v-half, v-min): ``B`` is the same backward step with the local
  linears' weight-gradient GEMMs collected under the pass's key
  (:mod:`epas_megatron.model.weight_grad`), ``W`` runs them; the store is armed for the whole
  iteration and must be empty at its end.

The ``1f1b`` lists on Megatron's placement equal Megatron-Core's 1F1B bit for bit; the V lists
equal it to fp32 rounding (gradients are accumulated in another order).

**What ran, when** (:func:`record_timelines`): inside that context every run appends this rank's
:class:`ExecutedTimeline` -- each compute action (``F``, ``B``, ``W``, ``BW``) with its start and
end (``time.perf_counter`` on the CPU; CUDA events on the current stream on a GPU, read after the
iteration), and the messages and bytes this rank sent and received. The bubble of those times is
:attr:`~epas_megatron.parallel.schedule_simulation.Simulation.bubble`'s, of what was executed
(:func:`executed_bubble`). Outside the context a run records nothing, allocates nothing for it,
and computes exactly what it computes without it.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Iterator, Optional, Sequence

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.pipeline_parallel import schedules as megatron_schedules

from epas_megatron.model.weight_grad import WEIGHT_GRAD_STORE
from epas_megatron.parallel.pipeline_p2p import Exchange, communication_plan
from epas_megatron.parallel.pipeline_schedule import Action, ScheduleActions


@dataclass
class ExecutedTimeline:
    """One rank's iteration as executed (:func:`record_timelines`): its compute actions in the order
    they ran, their start and end in seconds from the iteration's start, and its p2p traffic."""

    schedule: str
    """The schedule's name."""

    rank: int
    """Pipeline rank."""

    actions: list = field(default_factory=list)
    """Compute actions (:class:`~epas_megatron.parallel.pipeline_schedule.Action`), in order."""

    start: list = field(default_factory=list)
    """Seconds from the iteration's start to each action's start."""

    end: list = field(default_factory=list)
    """... to each action's end."""

    sent_messages: int = 0
    sent_bytes: int = 0
    """Bytes of the tensors this rank sent (each message: elements x element size)."""

    received_messages: int = 0
    received_bytes: int = 0

    @property
    def busy(self) -> float:
        """Seconds spent in compute actions."""
        return sum(e - s for s, e in zip(self.start, self.end))

    @property
    def span(self) -> float:
        """From the first compute action's start to the last one's end (``Simulation.span``)."""
        return self.end[-1] - self.start[0]

    @property
    def bubble(self) -> float:
        """This rank's idle share of its span, ``1 - busy / span``."""
        return 1.0 - self.busy / self.span

    def durations(self, kind: str) -> list[float]:
        """Seconds of each executed action of ``kind``."""
        return [e - s for a, s, e in zip(self.actions, self.start, self.end) if a.kind == kind]


def executed_bubble(timelines: Sequence[ExecutedTimeline]) -> float:
    """The bubble of one iteration from every rank's timeline, as
    :attr:`~epas_megatron.parallel.schedule_simulation.Simulation.bubble` defines it: the idle share
    of the rank with the longest span."""
    longest = max(timelines, key=lambda t: t.span)
    return longest.bubble


_RECORDING: Optional[list] = None
"""Where runs append their :class:`ExecutedTimeline` (None: nothing is recorded)."""


@contextlib.contextmanager
def record_timelines() -> Iterator[list]:
    """Record every :func:`run_pipeline_schedule` inside: yields the list each run appends this
    rank's :class:`ExecutedTimeline` to (after the run's sends completed)."""
    global _RECORDING
    outer, _RECORDING = _RECORDING, []
    try:
        yield _RECORDING
    finally:
        _RECORDING = outer


class _Recorder:
    """Fills an :class:`ExecutedTimeline` during a run: marks are host times on the CPU, CUDA
    events on a GPU (converted to seconds once the iteration is over)."""

    def __init__(self, schedule: ScheduleActions, rank: int, device: torch.device):
        self.timeline = ExecutedTimeline(schedule.name, rank)
        self.cuda = device.type == "cuda"
        self.marks: list = []
        self.origin = self.mark()

    def mark(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def begin(self, action: Action) -> None:
        self.timeline.actions.append(action)
        self.marks.append(self.mark())

    def end(self) -> None:
        self.marks.append(self.mark())

    def sent(self, tensor: torch.Tensor) -> None:
        self.timeline.sent_messages += 1
        self.timeline.sent_bytes += tensor.numel() * tensor.element_size()

    def received(self, tensor: torch.Tensor) -> None:
        self.timeline.received_messages += 1
        self.timeline.received_bytes += tensor.numel() * tensor.element_size()

    def finish(self) -> ExecutedTimeline:
        if self.cuda:
            torch.cuda.synchronize()
            seconds = [self.origin.elapsed_time(event) / 1000.0 for event in self.marks]
        else:
            seconds = [mark - self.origin for mark in self.marks]
        self.timeline.start, self.timeline.end = seconds[0::2], seconds[1::2]
        return self.timeline


def _message_tag(schedule: ScheduleActions, action: Action) -> int:
    """A tag per message of the iteration (activations and gradients apart, stage, micro-batch):
    gloo pairs by it; NCCL ignores it -- the plan posts in the senders' order, which pairs the
    same messages (the NCCL-rules transport checks the tags of the pairs it makes agree)."""
    kind = action.kind[-1]
    return ((0 if kind == "F" else 1) * schedule.stages + action.stage) * schedule.microbatches + action.microbatch


def _drop_completed(works: list) -> list:
    """The works still running; a completed one is waited for (raising what it failed with) and
    dropped, and with it the tensor it sent."""
    running = []
    for work in works:
        if work.is_completed():
            work.wait()
        else:
            running.append(work)
    return running


def run_pipeline_schedule(schedule: ScheduleActions, model_chunks: Sequence, data_iterators: Sequence[Iterator], *,
                          forward_step_func, seq_length: int, micro_batch_size: int, forward_only: bool = False) -> list:
    """This rank's part of ``schedule`` on ``model_chunks`` (one per chunk of the placement),
    reading each chunk's micro-batches from ``data_iterators``. Returns what Megatron's schedules
    return: the loss function's reported values, one per micro-batch, on the rank with the loss.
    Inside :func:`record_timelines`, also appends this rank's :class:`ExecutedTimeline`."""
    config = model_chunks[0].config
    group = parallel_state.get_pipeline_model_parallel_group()
    rank = parallel_state.get_pipeline_model_parallel_rank()
    if schedule.pp != parallel_state.get_pipeline_model_parallel_world_size():
        raise ValueError(f"a schedule for {schedule.pp} pipeline ranks on {parallel_state.get_pipeline_model_parallel_world_size()}")
    if len(model_chunks) != schedule.chunks_per_rank:
        raise ValueError(f"{schedule.name} runs {schedule.chunks_per_rank} chunk(s) per rank, got {len(model_chunks)}")
    (shape,) = megatron_schedules.get_tensor_shapes(seq_length=seq_length, micro_batch_size=micro_batch_size, decoder_seq_length=None,
                                                    config=config, tp_group=parallel_state.get_tensor_model_parallel_group(),
                                                    cp_group=parallel_state.get_context_parallel_group())
    device = next(model_chunks[0].parameters()).device
    dtype = config.pipeline_dtype
    last = schedule.stages - 1
    plan = communication_plan(schedule, forward_only)[rank]

    inputs: dict[tuple[int, int], torch.Tensor] = {}   # (stage, microbatch) -> the forward's input
    outputs: dict[tuple[int, int], torch.Tensor] = {}  # -> its output (a loss on the last stage)
    received: dict[tuple[str, int, int], torch.Tensor] = {}  # what a receive brought, for its pass
    local_grads: dict[tuple[int, int], torch.Tensor] = {}    # a gradient handed back inside this rank
    pending: list = []  # works of exchanges not waited for yet (they hold the tensors they send)
    forward_data_store: list = []
    total_tokens = torch.zeros([], dtype=torch.int, device=device)

    no_sync = contextlib.ExitStack()
    if not forward_only and config.no_sync_func is not None:
        funcs = config.no_sync_func if isinstance(config.no_sync_func, list) else [config.no_sync_func]
        for func in funcs:
            no_sync.enter_context(func())

    def peer(action: Action) -> int:
        return dist.get_global_rank(group, action.peer)

    def exchange(step: Exchange) -> None:
        """Post the step's sends and receives as one batch; wait for it (and every earlier one) if
        it receives or would leave too many sends pending (pipeline_p2p's plan)."""
        nonlocal pending
        ops, buffers = [], []
        for action in step.sends:
            key = (action.stage, action.microbatch)
            if action.kind == "SEND_F":
                tensor = outputs.pop(key) if forward_only else outputs[key]
            else:
                tensor = inputs.pop(key).grad
            payload = tensor.detach().contiguous()
            ops.append(dist.P2POp(dist.isend, payload, peer(action), group, _message_tag(schedule, action)))
            if recorder is not None:
                recorder.sent(payload)
            if action.kind == "SEND_F":  # as Megatron's schedules: only its grad_fn is needed now (the send holds the data)
                megatron_schedules.deallocate_output_tensor(tensor, config.deallocate_pipeline_outputs)
        for action in step.receives:
            buffer = torch.empty(shape, dtype=dtype, device=device)
            ops.append(dist.P2POp(dist.irecv, buffer, peer(action), group, _message_tag(schedule, action)))
            buffers.append(((action.kind[-1], action.stage, action.microbatch), buffer))
            if recorder is not None:
                recorder.received(buffer)
        works = dist.batch_isend_irecv(ops)
        del ops  # the works alone hold what is sent: dropping them frees it
        if not step.waits:
            pending += works
            return
        for work in pending + works:
            work.wait()
        pending = []
        for message, buffer in buffers:
            received[message] = buffer.requires_grad_() if message[0] == "F" else buffer

    recorder = _Recorder(schedule, rank, device) if _RECORDING is not None else None
    split = not forward_only and schedule.split_backward
    if split:  # the local linears defer their weight-gradient GEMMs to the W passes
        no_sync.enter_context(WEIGHT_GRAD_STORE.arming())
    with no_sync:
        for action in plan:
            if isinstance(action, Exchange):
                exchange(action)
                continue
            pending = _drop_completed(pending)
            key = (action.stage, action.microbatch)
            chunk = schedule.chunk_of(action.stage)
            if recorder is not None:
                recorder.begin(action)
            if action.kind == "F":
                if action.stage == 0:
                    input_tensor = None
                elif schedule.rank_of(action.stage - 1) == rank:  # V placement's turn: no send
                    handed = (outputs.pop if forward_only else outputs.get)((action.stage - 1, action.microbatch))
                    input_tensor = handed.detach().requires_grad_()
                    megatron_schedules.deallocate_output_tensor(handed, config.deallocate_pipeline_outputs)
                else:
                    input_tensor = received.pop(("F", action.stage - 1, action.microbatch))
                output, tokens = megatron_schedules.forward_step(
                    forward_step_func, data_iterators[chunk], model_chunks[chunk], schedule.microbatches, input_tensor,
                    forward_data_store, config, cp_group_size=1, current_microbatch=action.microbatch,
                    is_first_microbatch=action.microbatch == 0, is_last_stage=action.stage == last)
                total_tokens += tokens
                outputs[key] = output
                if not forward_only:
                    inputs[key] = input_tensor
            elif action.kind in ("BW", "B"):
                if action.stage == last:
                    output_grad = None
                elif schedule.rank_of(action.stage + 1) == rank:
                    output_grad = local_grads.pop(key)
                else:
                    output_grad = received.pop(("B", action.stage + 1, action.microbatch))
                input_tensor, output = inputs[key], outputs.pop(key)
                with (WEIGHT_GRAD_STORE.collecting(key) if action.kind == "B" else contextlib.nullcontext()):
                    megatron_schedules.backward_step(input_tensor, output, output_grad, config)
                if action.stage > 0 and schedule.rank_of(action.stage - 1) == rank:
                    local_grads[(action.stage - 1, action.microbatch)] = input_tensor.grad
                if action.stage == 0 or schedule.rank_of(action.stage - 1) == rank:
                    inputs.pop(key)  # else its SEND_B takes the gradient and drops it
            elif action.kind == "W":
                WEIGHT_GRAD_STORE.run(key)
            else:
                raise ValueError(f"{schedule.name}: the executor does not run {action.kind}")
            if recorder is not None:
                recorder.end()
        for work in pending:
            work.wait()
        pending = []
    if recorder is not None:
        _RECORDING.append(recorder.finish())

    if not forward_only and config.finalize_model_grads_func is not None:
        if config.calculate_per_token_loss:
            # The tokens are counted where the loss is (V placement: rank 0); Megatron takes them
            # from the last pipeline rank: every rank gets the sum first.
            dist.all_reduce(total_tokens, group=group)
        config.finalize_model_grads_func(list(model_chunks), total_tokens if config.calculate_per_token_loss else None)
    return forward_data_store
