"""EleutherAI's lm-evaluation-harness on one checkpoint at any sharing region.

    from epas_megatron.evaluation.lm_eval_model import markdown_table, run_lm_eval
    results = run_lm_eval("runs/demo/checkpoints", "0,2,max", ["hellaswag", "arc_easy"])
    print(markdown_table(results))          # one row per task and metric, one column per region

:class:`EpasLM` is an ``lm_eval`` model (registered as ``epas``) over a checkpoint built at one
region by :meth:`Generator.from_checkpoint <epas_megatron.inference.generator.Generator.from_checkpoint>`,
so the model, the tokenizer and the region rules are those of ``epas-generate``. The harness
itself runs with ``python -m epas_megatron.evaluation.lm_eval_model --model epas --model_args
load=CKPT,region=2 --tasks ...`` (the module registers the model, then hands over to lm_eval's
own command line). ``lm_eval`` is an optional dependency (``pip install lm-eval``): this module
imports it, so import it only on the lm-eval path.

Decisions:

- **Scores come from the plain forward of the built Megatron model**, not from the decode
  engine's prefill: it is the computation training and ``epas-eval``'s validation loss use (so
  lm-eval scores and validation loss come from one code path), right-padding is exact under
  its causal attention (no mask or position offsets), and it runs SDPA kernels without the
  engine's ``[b, g, q, T]`` probability tensors. The engine serves ``generate_until``.
- **Tokenisation is lm_eval's HF rule**: trailing whitespace of the context moves to the
  continuation; ``context + continuation`` is encoded whole and the continuation is what follows
  the first ``len(encode(context))`` tokens. No BOS is added (the project's tokenizer adds none).
- **An empty context (and the start of a rolling window) is the EOS token**: pretraining here
  separates documents by EOD = EOS and never emits BOS, so "after EOS" is where documents start.
- Sequences longer than the model's context are left-truncated; the continuation is always kept.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Optional

import torch
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from torch import distributed as dist

from epas_megatron.assembly import checkpoint_regions
from epas_megatron.checkpointing.integrity import open_checkpoint
from epas_megatron.errors import ConfigError
from epas_megatron.inference.generator import Generator
from epas_megatron.inference.sampling import SamplingParams
from epas_megatron.runtime.device import to_compute_device
from epas_megatron.runtime.distributed import destroy_distributed, init_distributed
from epas_megatron.sharing.shape import LayerMode

DEFAULT_BATCH_SIZE = 8
"""Sequences per forward (loglikelihood) or per generation batch."""

DEFAULT_MAX_GEN_TOKS = 256
"""Tokens generated when a task's ``gen_kwargs`` give no ``max_gen_toks``."""


@register_model("epas")
class EpasLM(LM):
    """An lm_eval model: one checkpoint at one sharing region (one process, TP = PP = 1)."""

    def __init__(self, load: Optional[str] = None, region: int | str = "max", allow_untrained_region: bool = False,
                 precision: str = "auto", batch_size: int | str = DEFAULT_BATCH_SIZE,
                 max_gen_toks: int = DEFAULT_MAX_GEN_TOKS, generator=None, max_batch_size=None, device=None):
        """Build from ``load`` at ``region`` (or wrap a built ``generator``). ``max_batch_size``
        and ``device`` are what lm_eval's command line passes to every model; the device here is
        the project's compute device (the GPU when there is one)."""
        super().__init__()
        if generator is None:
            if load is None:
                raise ConfigError("the epas model needs load=CHECKPOINT (e.g. --model_args load=runs/x/checkpoints,region=2)")
            generator = Generator.from_checkpoint(load, region=region, allow_untrained_region=allow_untrained_region,
                                                  precision=precision)
        self.generator = generator
        self.tokenizer = generator.tokenizer
        self.max_length = generator.max_length
        """Longest sequence the model runs (its trained context); longer inputs are left-truncated."""
        self.vocab_size = self.tokenizer.vocab_size
        """Real tokens; the padded rows of the output layer are never scored."""
        self.batch_size = _positive_int(batch_size, "batch size (--lm-eval-batch-size)")
        self.max_gen_toks = _positive_int(max_gen_toks, "max_gen_toks")

    @property
    def eot_token_id(self) -> int:
        """The context of an empty context and of the first rolling window (see the module notes)."""
        return self.tokenizer.eos

    @property
    def tokenizer_name(self) -> str:
        """Fingerprints lm_eval's request caches: the tokenizer's content, not its path."""
        return f"sentencepiece-{self.tokenizer.sha256[:16]}"

    @property
    def sharing_layers(self) -> list[int]:
        """The layers that run in sharing mode, as built (the checkpoint decides where regions end)."""
        return [index for index, mode in enumerate(self.generator.engine.modes) if mode == LayerMode.SHARE]

    def get_model_info(self) -> dict:
        """Merged into lm_eval's ``results['config']``."""
        return {"checkpoint": str(self.generator.checkpoint), "region": self.generator.region,
                "sharing_layers": self.sharing_layers, "trained_region": self.generator.trained_region,
                "max_length": self.max_length}

    # ---------------------------------------------------------------- tokenisation
    def encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """(context ids, continuation ids) by the rule in the module notes. A context of
        whitespace only is empty once its whitespace has moved: EOS then too."""
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        if context == "":
            return [self.eot_token_id], self.tokenizer.tokenize(continuation)
        context_ids = self.tokenizer.tokenize(context)
        whole = self.tokenizer.tokenize(context + continuation)
        return context_ids, whole[len(context_ids):]

    # ---------------------------------------------------------------- requests
    def loglikelihood(self, requests) -> list[tuple[float, bool]]:
        """(log P(continuation | context), whether greedy decoding produces the continuation)."""
        pairs = [self.encode_pair(*_args(request)) for request in requests]
        results = self.score_tokens(pairs)
        for request, result in zip(requests, results):
            self.cache_hook.add_partial("loglikelihood", _args(request), result)
        return results

    def loglikelihood_rolling(self, requests) -> list[float]:
        """log P(text) over disjoint windows of the model's context: the first window starts at
        EOS, every later one conditions on the tokens before it up to the full context, and
        every token is predicted exactly once (lm_eval's rolling-window definition)."""
        windows, owners = [], []
        for number, request in enumerate(requests):
            (text,) = _args(request)
            for window in get_rolling_token_windows(self.tokenizer.tokenize(text), prefix_token=self.eot_token_id,
                                                    max_seq_len=self.max_length, context_len=1):
                windows.append(make_disjoint_window(window))
                owners.append(number)
        totals = [0.0] * len(requests)
        for owner, (logprob, _) in zip(owners, self.score_tokens(windows)):
            totals[owner] += logprob
        for request, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", _args(request), total)
        return totals

    def generate_until(self, requests) -> list[str]:
        """Continuations from :meth:`Generator.generate` (greedy unless ``do_sample``), cut before
        the first ``until`` string. The generator has no stop strings, so each batch decodes up
        to ``max_gen_toks`` tokens (or EOS) and the text is cut afterwards."""
        outputs: list[Optional[str]] = [None] * len(requests)
        groups: dict[str, list[int]] = {}
        for number, request in enumerate(requests):
            groups.setdefault(json.dumps(_args(request)[1], sort_keys=True, default=str), []).append(number)
        for numbers in groups.values():
            until, max_gen_toks, sampling = self._generation_settings(_args(requests[numbers[0]])[1])
            budget = self.max_length - max_gen_toks  # prompt tokens that fit before the new ones
            prompts = {}
            for number in numbers:
                ids = self.tokenizer.tokenize(_args(requests[number])[0]) or [self.eot_token_id]
                prompts[number] = ids[-budget:]
            order = sorted(numbers, key=lambda n: -len(prompts[n]))
            for start in range(0, len(order), self.batch_size):
                batch = order[start:start + self.batch_size]
                results = self.generator.generate([prompts[n] for n in batch], max_new_tokens=max_gen_toks, sampling=sampling)
                for number, result in zip(batch, results):
                    outputs[number] = cut_at_stop(result.text, until)
                    self.cache_hook.add_partial("generate_until", _args(requests[number]), outputs[number])
        return outputs

    def _generation_settings(self, gen_kwargs: dict) -> tuple[list[str], int, SamplingParams]:
        kwargs = dict(gen_kwargs or {})
        until = kwargs.get("until") or []
        until = [until] if isinstance(until, str) else list(until)
        max_gen_toks = next((kwargs[k] for k in ("max_gen_toks", "max_new_tokens", "max_tokens") if kwargs.get(k)),
                            self.max_gen_toks)
        max_gen_toks = _positive_int(max_gen_toks, "max_gen_toks")
        if max_gen_toks >= self.max_length:
            raise ConfigError(f"max_gen_toks {max_gen_toks} leaves no room for a prompt in the model's "
                              f"{self.max_length}-token context; ask for fewer tokens")
        temperature = float(kwargs.get("temperature") or 0.0)
        if not kwargs.get("do_sample", temperature > 0):
            return until, max_gen_toks, SamplingParams()
        sampling = SamplingParams(temperature=temperature or 1.0, top_k=int(kwargs.get("top_k") or 0),
                                  top_p=float(kwargs.get("top_p") or 1.0), seed=int(kwargs.get("seed") or 0))
        return until, max_gen_toks, sampling

    # ---------------------------------------------------------------- scoring
    @torch.inference_mode()
    def score_tokens(self, pairs: Sequence[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """(sum of log-probabilities, all tokens greedy) of each continuation after its context.

        Longest first (lm_eval's order: the first batch shows at once whether memory suffices),
        ``batch_size`` right-padded rows per forward, results in the order given."""
        model = self.generator.engine.model
        inputs, results = [], [None] * len(pairs)
        for context_ids, continuation_ids in pairs:
            if len(continuation_ids) > self.max_length:
                raise ConfigError(f"a continuation of {len(continuation_ids)} tokens does not fit the model's "
                                  f"{self.max_length}-token context")
            # The last max_length + 1 tokens: inputs are all but the last, targets all but the first.
            inputs.append((context_ids + continuation_ids)[-(self.max_length + 1):][:-1])
        order = sorted(range(len(pairs)), key=lambda i: -len(inputs[i]))
        for start in range(0, len(order), self.batch_size):
            batch = order[start:start + self.batch_size]
            width = len(inputs[batch[0]])
            tokens = torch.full((len(batch), width), self.eot_token_id, dtype=torch.long)
            for row, i in enumerate(batch):
                tokens[row, :len(inputs[i])] = torch.tensor(inputs[i])
            positions = torch.arange(width).expand(len(batch), width)
            # [b, s] -> [b, s, padded vocab]; causal attention: the right padding changes no real position.
            logits = model(to_compute_device(tokens), to_compute_device(positions), None)
            for row, i in enumerate(batch):
                continuation = pairs[i][1]
                if not continuation:
                    results[i] = (0.0, True)
                    continue
                end = len(inputs[i])
                # [n, vocab]: the positions that predict the continuation's n tokens
                logprobs = torch.log_softmax(logits[row, end - len(continuation):end, :self.vocab_size].float(), dim=-1)
                targets = torch.tensor(continuation, device=logprobs.device)
                total = logprobs.gather(-1, targets[:, None]).sum()
                results[i] = (float(total), bool((logprobs.argmax(-1) == targets).all()))
        return results


def cut_at_stop(text: str, until: Sequence[str]) -> str:
    """``text`` up to (not including) the earliest occurrence of any stop string."""
    cut = min((text.find(stop) for stop in until if stop and stop in text), default=len(text))
    return text[:cut]


def task_manager_for(tasks: Sequence[str], include_path: Optional[str | Path] = None):
    """An lm_eval TaskManager that knows every name in ``tasks``; ConfigError naming
    ``--lm-eval-tasks`` for an unknown one (checked before any model is built).

    Tasks found in ``include_path`` alone skip scanning lm_eval's ~15,000 built-in configs (~5 s)."""
    from lm_eval.tasks import TaskManager

    if include_path is not None:
        custom = TaskManager(include_path=str(include_path), include_defaults=False)
        # Plain tasks only: a group or tag of the include path may name built-in tasks.
        if set(tasks) <= set(getattr(custom, "all_subtasks", ())):
            return custom
    manager = TaskManager(include_path=str(include_path) if include_path is not None else None)
    unknown = [name for name in tasks if name not in manager.all_tasks and not Path(name).is_file()]
    if unknown:
        where = f" or in --lm-eval-include-path {include_path}" if include_path is not None else ""
        raise ConfigError(f"--lm-eval-tasks: unknown task {', '.join(map(repr, unknown))} (not among lm_eval's "
                          f"{len(manager.all_tasks)} tasks, groups and tags{where}; `lm-eval ls tasks` lists them)")
    return manager


def run_lm_eval(load: str | Path, regions: str | Sequence[int | str], tasks: str | Sequence[str],
                include_path: Optional[str | Path] = None, limit: Optional[int] = None,
                batch_size: int = DEFAULT_BATCH_SIZE, num_fewshot: Optional[int] = None, allow_untrained: bool = False,
                precision: str = "auto", task_manager=None, bootstrap_iters: int = 100000) -> dict:
    """``lm_eval.simple_evaluate`` once per region on one checkpoint.

    Returns ``{"checkpoint", "iteration", "trained_region", "tasks", "limit", "num_fewshot",
    "regions": [{"region", "sharing_layers", "results", "n_samples", "n_shot", "versions"}]}``,
    where ``results`` is lm_eval's ``{task: {"acc,none": ..., "acc_stderr,none": ...}}``."""
    import lm_eval

    checkpoint, meta = open_checkpoint(load, "--load")
    text = regions if isinstance(regions, str) else ",".join(str(r) for r in regions)
    region_list = checkpoint_regions(meta, text, allow_untrained)
    names = [t.strip() for t in tasks.split(",")] if isinstance(tasks, str) else list(tasks)
    if task_manager is None:
        task_manager = task_manager_for(names, include_path)

    started = not dist.is_initialized()
    if started:
        init_distributed(1, 1, None, seed=0)
    per_region = []
    try:
        for region in region_list:
            generator = Generator.from_checkpoint(checkpoint, region=region, allow_untrained_region=allow_untrained,
                                                  precision=precision)
            model = EpasLM(generator=generator, batch_size=batch_size)
            output = lm_eval.simple_evaluate(model=model, tasks=names, task_manager=task_manager, limit=limit,
                                             num_fewshot=num_fewshot, log_samples=False, bootstrap_iters=bootstrap_iters)
            per_region.append({"region": region, "sharing_layers": model.sharing_layers,
                               "results": output["results"], "n_samples": output.get("n-samples", {}),
                               "n_shot": output.get("n-shot", {}), "versions": output.get("versions", {})})
            del model, generator
    finally:
        if started:
            destroy_distributed()
    return {"checkpoint": str(checkpoint), "iteration": meta.iteration, "trained_region": meta.trained_region,
            "tasks": names, "limit": limit, "num_fewshot": num_fewshot, "regions": per_region}


def markdown_table(results: dict) -> str:
    """One table: a row per task and metric (``value ± stderr``), a column per region, and an
    average row over the requested tasks when several of them report ``acc`` (the paper's
    summary: an unweighted mean over tasks)."""
    regions = results["regions"]
    trained = results.get("trained_region", 0)
    heads = [f"region {r['region']}" + (" (untrained)" if r["region"] > trained else "") for r in regions]
    lines = ["| task | metric | " + " | ".join(heads) + " |", "|---|---|" + "---|" * len(regions)]
    rows = []  # (task, metric key) in the first region's order
    for task, metrics in regions[0]["results"].items() if regions else ():
        rows += [(task, key) for key in metrics if "," in key and not key.split(",")[0].endswith("_stderr")]
    for task, key in rows:
        metric, filter_name = key.split(",", 1)
        label = metric if filter_name == "none" else f"{metric} ({filter_name})"
        stderr_key = f"{metric}_stderr,{filter_name}"
        cells = [_cell(r["results"].get(task, {}).get(key), r["results"].get(task, {}).get(stderr_key)) for r in regions]
        lines.append(f"| {regions[0]['results'][task].get('alias', task).strip()} | {label} | " + " | ".join(cells) + " |")
    with_acc = [t for t in results.get("tasks", []) if all(_number(r["results"].get(t, {}).get("acc,none")) for r in regions)]
    if len(with_acc) > 1:
        means = [sum(r["results"][t]["acc,none"] for t in with_acc) / len(with_acc) for r in regions]
        lines.append(f"| average ({len(with_acc)} tasks) | acc | " + " | ".join(_cell(m, None) for m in means) + " |")
    return "\n".join(lines)


def _cell(value, stderr) -> str:
    if not _number(value):
        return "n/a" if value is None else str(value)
    text = f"{value:.4f}" if abs(value) < 1000 else f"{value:.1f}"
    return text + (f" ± {stderr:.4f}" if _number(stderr) else "")


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _args(request) -> tuple:
    """An lm_eval ``Instance``'s arguments (plain tuples are accepted too)."""
    return tuple(getattr(request, "args", request))


def _positive_int(value, flag: str) -> int:
    try:
        number = int(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{flag} {value!r}: give a positive integer ('auto' is not supported)") from None
    if number < 1 or number != float(value):
        raise ConfigError(f"{flag} {value!r}: must be a positive integer")
    return number


if __name__ == "__main__":
    # lm_eval's own command line with the `epas` model registered above.
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()
