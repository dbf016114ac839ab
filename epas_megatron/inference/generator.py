"""Text generation from a checkpoint at any sharing region: the Python API behind ``epas-generate``.

    from epas_megatron.inference.generator import Generator
    gen = Generator.from_checkpoint("runs/demo/checkpoints", region=2)
    for result in gen.generate(["The history of"], max_new_tokens=32):
        print(result.text)

One checkpoint serves every region from 0 to the one it was trained with (larger only with
``allow_untrained_region``): the model is built with that region's layer specs and the
checkpoint loaded into it, exactly as ``epas-eval`` does. Prompts of different lengths are
left-padded into one batch (see :mod:`epas_megatron.inference.kv_cache`), prefilled in chunks,
then decoded one token per step until every row has produced ``eos`` or ``max_new_tokens``. On
a GPU the decode steps replay one CUDA graph of a fixed-shape step (``decode_step='auto'``; see
:mod:`epas_megatron.inference.decode_step`); the cache is sized to the prompt plus
``max_new_tokens``, which such a step reads whole. A Mixture-of-Channels checkpoint generates with
its Top-K MLPs (the checkpoint records ``--moc-topk``); ``moc_decode='sparse'`` makes its decode
steps read only the kept rows of ``W_down`` (:mod:`epas_megatron.inference.moc_decode`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch
from torch import distributed as dist

from epas_megatron.assembly import checkpoint_regions, plan_for_checkpoint
from epas_megatron.checkpointing.checkpoint import load_checkpoint
from epas_megatron.checkpointing.integrity import open_checkpoint
from epas_megatron.data.tokenizer import load_tokenizer
from epas_megatron.errors import ConfigError
from epas_megatron.inference.decode_step import StaticDecodeStep, resolve_decode_step
from epas_megatron.inference.engine import DecodeEngine
from epas_megatron.inference.sampling import SamplingParams, next_tokens
from epas_megatron.model.builder import build_model
from epas_megatron.runtime.distributed import init_distributed

PREFILL_CHUNK = 256
"""Prompt positions per prefill forward (bounds the ``[b, g, q·n, T]`` probabilities' memory)."""


@dataclass
class GenerationResult:
    """One prompt's generation."""

    prompt_tokens: list[int]
    """The prompt's token ids."""

    tokens: list[int] = field(default_factory=list)
    """Generated token ids (the ``eos`` that stopped it included)."""

    finish_reason: str = "length"
    """'eos' (the model produced the end token) or 'length' (``max_new_tokens`` reached)."""

    text: Optional[str] = None
    """The generated tokens detokenised (``eos`` left out), when a tokenizer is known."""


class Generator:
    """Greedy or sampled generation with a KV cache over a built, loaded model (TP = PP = 1)."""

    def __init__(self, model, tokenizer=None, decode_attention: str = "auto", region_kernel: Optional[str] = None,
                 decode_step: str = "auto", moc_decode: str = "masked"):
        share = _share_of(model)
        if decode_attention == "auto":
            decode_attention = "reuse" if share == "qk" else "qk"
        # moc_decode: 'sparse' -- a Mixture-of-Channels model's decode steps read only the kept rows of W_down
        self.engine = DecodeEngine(model, decode_attention, region_kernel, moc_decode)
        resolve_decode_step(decode_step, self.engine.device)  # a bad choice fails here, not at generate()
        self.decode_step = decode_step
        """'auto', 'eager', 'static' or 'cuda-graph' (:mod:`epas_megatron.inference.decode_step`)."""
        self.tokenizer = tokenizer
        self.max_length = self.engine.model.max_sequence_length
        """Longest sequence (prompt + generated tokens): the trained context."""
        self.checkpoint: Optional[Path] = None
        self.trained_region: Optional[int] = None

    @property
    def region(self) -> int:
        """Sharing layers of the model being run."""
        return sum(mode == "share" for mode in self.engine.modes)

    @classmethod
    def from_checkpoint(cls, load: str | Path, region: int | str | None = None, *, allow_untrained_region: bool = False,
                        decode_attention: str = "auto", region_kernel: Optional[str] = None,
                        precision: str = "auto", tokenizer_model: Optional[str] = None,
                        decode_step: str = "auto", moc_decode: str = "masked") -> "Generator":
        """Build the model at ``region`` sharing layers (None / 'max': the trained region; the
        block ends where the checkpoint's regions end, see ``--epas-exclude-last``) and load
        ``load`` (a checkpoint root or an ``iter_*`` directory) into it. Starts a world of one
        process if none is running."""
        checkpoint, meta = open_checkpoint(load, "--load", needs_config=True)
        text = "max" if region is None else str(region)
        (region,) = checkpoint_regions(meta, text, allow_untrained_region, flag="--region")
        tokenizer_path = tokenizer_model or meta.tokenizer_model
        if tokenizer_path is None or not Path(tokenizer_path).is_file():
            raise ConfigError(f"the checkpoint's tokenizer {tokenizer_path!r} is not there; pass --tokenizer-model")
        tokenizer = load_tokenizer(tokenizer_path)

        if dist.is_initialized() and dist.get_world_size() > 1:
            raise ConfigError("epas-generate runs in one process (TP = PP = 1); do not start it with torchrun")
        if not dist.is_initialized():
            init_distributed(1, 1, None, seed=0)
        plan = plan_for_checkpoint(meta, region, flag="--region", precision=precision, backend="local")
        chunks = build_model(plan, seed=0).chunks
        load_checkpoint(checkpoint, chunks, restore_rng=False)
        generator = cls(chunks[0], tokenizer, decode_attention, region_kernel, decode_step, moc_decode)
        generator.checkpoint, generator.trained_region = checkpoint, meta.trained_region
        return generator

    def encode(self, prompts: Sequence[str | Sequence[int]]) -> list[list[int]]:
        """Token ids of each prompt (strings need the tokenizer); empty prompts are refused."""
        if not prompts:
            raise ConfigError("no prompt given (--prompt TEXT or --prompt-file FILE)")
        encoded = []
        for number, prompt in enumerate(prompts, 1):
            if isinstance(prompt, str):
                if self.tokenizer is None:
                    raise ConfigError("text prompts need a tokenizer; pass token ids instead")
                ids = self.tokenizer.tokenize(prompt)
            else:
                ids = [int(t) for t in prompt]
            if not ids:
                raise ConfigError(f"prompt {number} is empty")
            encoded.append(ids)
        return encoded

    @torch.inference_mode()
    def generate(self, prompts: Sequence[str | Sequence[int]], max_new_tokens: int = 32,
                 sampling: SamplingParams = SamplingParams(), eos_id: Optional[int] = None,
                 stream: Optional[Callable[[int, int], None]] = None) -> list[GenerationResult]:
        """Continue every prompt; ``stream(row, token)`` is called for each new token as it comes."""
        encoded = self.encode(prompts)
        if max_new_tokens < 1:
            raise ConfigError(f"--max-new-tokens {max_new_tokens}: must be >= 1")
        longest = max(len(ids) for ids in encoded)
        if longest + max_new_tokens > self.max_length:
            raise ConfigError(
                f"a prompt of {longest} tokens plus --max-new-tokens {max_new_tokens} exceeds the model's context of "
                f"{self.max_length} positions; shorten the prompt or generate fewer tokens")
        if eos_id is None and self.tokenizer is not None:
            eos_id = self.tokenizer.eos
        engine, device = self.engine, self.engine.device
        batch = len(encoded)
        cache = engine.new_cache(batch, longest + max_new_tokens)
        tokens = torch.zeros(batch, longest, dtype=torch.long)
        for row, ids in enumerate(encoded):
            tokens[row, longest - len(ids):] = torch.tensor(ids)
            cache.pad[row] = longest - len(ids)
        tokens = tokens.to(device)
        for start in range(0, longest, PREFILL_CHUNK):
            logits = engine.forward(tokens[:, start:start + PREFILL_CHUNK], cache)
        mode = resolve_decode_step(self.decode_step, device, decode_steps=max_new_tokens - 1)
        if mode == "eager" or max_new_tokens == 1:
            decode = functools.partial(engine.forward, cache=cache)
        else:
            # its logits live in the step's static buffer: sampled from before the next step
            decode = StaticDecodeStep(engine, cache, graph=mode == "cuda-graph")

        generator = None if sampling.greedy else torch.Generator(device=device).manual_seed(sampling.seed)
        vocab = self.tokenizer.vocab_size if self.tokenizer is not None else None
        results = [GenerationResult(prompt_tokens=ids) for ids in encoded]
        done = torch.zeros(batch, dtype=torch.bool)
        for step in range(max_new_tokens):
            step_logits = logits[:, -1]
            if vocab is not None:
                step_logits[:, vocab:] = float("-inf")  # the padded vocabulary rows are never tokens
            chosen = next_tokens(step_logits, sampling, generator)
            for row, token in enumerate(chosen.tolist()):
                if done[row]:
                    continue
                results[row].tokens.append(token)
                if stream is not None:
                    stream(row, token)
                if token == eos_id:
                    results[row].finish_reason = "eos"
                    done[row] = True
            if bool(done.all()) or step == max_new_tokens - 1:
                break
            logits = decode(chosen[:, None])
        if self.tokenizer is not None:
            for result in results:
                body = result.tokens[:-1] if result.finish_reason == "eos" else result.tokens
                result.text = self.tokenizer.detokenize(body)
        return results


def _share_of(model) -> str:
    from epas_megatron.model.attention import SharedAttention
    from epas_megatron.runtime.wrapping import unwrap_model

    for layer in unwrap_model(model).decoder.layers:
        if isinstance(layer.self_attention, SharedAttention):
            return layer.self_attention.share
    return "qk"
