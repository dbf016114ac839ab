"""Run under torchrun (two ranks): one step, then the run's first switch with torch's CPU
allocation counter around it (as tests/switch_memory_check.py measures one process); each rank
prints ``RESULT {json}``: its measured peak above the state it started from, the memory model's
bound for its own switch (its layers before and after: a re-layout moves layers between pipeline
ranks) and the state before."""

import contextlib
import io
import json
import sys

import torch
import torch.distributed as dist

from megatron.core import parallel_state

from epas_megatron.assembly import memory_settings
from epas_megatron.config.cli import parse_config
from epas_megatron.metrics.rank_memory import rank_memory_bytes
from epas_megatron.metrics.switch_memory import switch_transient_terms
from epas_megatron.model.architecture import ModelShape
from epas_megatron.runtime.wrapping import unwrap_model
from epas_megatron.sharing.shape import LayerMode
from epas_megatron.training.trainer import Trainer
from epas_megatron.validation import resolve_run
from switch_memory_check import _cpu_peaks


def layer_ids(model) -> list[int]:
    return [layer.layer_number - 1 for chunk in model for layer in unwrap_model(chunk).decoder.layers]


def main(argv):
    run = resolve_run(parse_config(argv))
    trainer = Trainer(run)
    profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True)
    try:
        with profiler as prof:
            with contextlib.redirect_stdout(io.StringIO()):
                trainer.setup()
            trainer._train_step()
            trainer.iteration += 1
            (iteration, _), *_ = run.schedule.switch_iterations()
            before = layer_ids(trainer.model)
            with torch.profiler.record_function("epas_switch"):
                with torch.profiler.record_function("epas_switch_build"):
                    trainer.apply_switch(tuple(run.schedule.sharing_layers(iteration)))
            after = layer_ids(trainer.model)
        arch = trainer.plan.arch
        pp_rank, rank = parallel_state.get_pipeline_model_parallel_rank(), dist.get_rank()
    finally:
        trainer.close()
    peak, _ = _cpu_peaks(prof)
    t = run.cfg.training
    shape = ModelShape(arch, t.seq_length, t.micro_batch_size)
    roles = lambda it: ["share" if mode == LayerMode.SHARE else "compute" for mode in run.schedule.layer_modes(it)]
    settings = memory_settings(run)
    terms = switch_transient_terms(shape, roles(iteration - 1), roles(iteration), before, after, pp_rank, run.cfg.parallel.pp,
                                   settings)
    state = rank_memory_bytes(shape, [[roles(iteration - 1)[i] for i in before]], pp_rank, run.cfg.parallel.pp, 1,
                              settings)["parameters"]
    print("RESULT " + json.dumps({"rank": rank, "peak": peak, "model": terms, "state": state,
                                  "before": before, "after": after}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
