"""A fixed-shape decode step, captured once as a CUDA graph and replayed for every token.

A decode step of a small batch launches a few hundred small kernels (per layer: two norms, the
projections, RoPE, the cache writes, two attention products, the softmax, the MLP); on a GPU
their launch overhead, more than the bytes they read, can bound the step. Capturing the step as
a CUDA graph and replaying it per token removes that overhead. A graph replays fixed shapes at
fixed addresses, so the step (:meth:`DecodeEngine.decode_step
<epas_megatron.inference.engine.DecodeEngine.decode_step>`):

* reads its inputs from static buffers: ``tokens [b, 1]`` and ``slot [1]``, the write slot as a
  device tensor filled before each replay (no Python value of the step depends on the position);
* writes K/V with ``index_copy_`` at ``slot`` and attends over all ``max_length`` slots of the
  preallocated cache, the later slots masked -- so every step reads the whole buffer: size the
  cache to what will be generated, as :class:`~epas_megatron.inference.generator.Generator` does.
  The later slots hold zeros (the cache is allocated zeroed) or an earlier sequence's values:
  their probabilities are exactly 0 and their values finite, so they add exactly nothing;
* leaves its logits in a static output buffer, **valid until the next step**.

Modes (``--decode-step``):

=============  ================================================================================
``eager``      :meth:`DecodeEngine.forward` per token (reads slots ``[:end]`` only)
``static``     the fixed-shape step run eagerly: what the graph replays, and how its logic is
               tested on CPU
``cuda-graph`` the fixed-shape step captured once per cache and replayed per token
``auto``       ``cuda-graph`` on CUDA when at least :data:`AUTO_GRAPH_MIN_STEPS` decode steps
               follow (a capture costs a few steps), ``eager`` otherwise
=============  ================================================================================

Capture follows PyTorch's recipe: :data:`WARMUP_STEPS` steps on a side stream first (lazy
initialisation -- cuBLAS workspaces, Triton and TorchScript compilation, the RoPE table --
happens outside the graph), then ``torch.cuda.graph``. Warm-up and capture run at the cache's
next slot with whatever the token buffer holds: they write that slot's K/V, which the first real
step overwrites before anything reads it (every layer writes its new slot before attending), and
they leave ``cache.length`` alone. A capture that raises warns and falls back to the static step
run eagerly (the same numbers, the launch overhead back). Nothing here has run on a GPU yet
(``tests/gpu/test_gpu_inference.py`` is the check).
"""

from __future__ import annotations

import warnings

import torch
from torch import Tensor

from epas_megatron.errors import ConfigError

DECODE_STEP_CHOICES = ("auto", "eager", "static", "cuda-graph")

AUTO_GRAPH_MIN_STEPS = 8
"""``auto`` captures a graph only when at least this many decode steps will replay it."""

WARMUP_STEPS = 3
"""Eager steps on a side stream before the capture (TorchScript fusers profile twice)."""


def resolve_decode_step(mode: str, device: torch.device, decode_steps: int | None = None) -> str:
    """The mode to run: ``auto`` resolved for ``device`` and ``decode_steps`` (None: many);
    ``cuda-graph`` refused off CUDA."""
    if mode not in DECODE_STEP_CHOICES:
        raise ConfigError(f"--decode-step {mode!r}: choose one of {', '.join(DECODE_STEP_CHOICES)}")
    cuda = torch.device(device).type == "cuda"
    if mode == "auto":
        many = decode_steps is None or decode_steps >= AUTO_GRAPH_MIN_STEPS
        return "cuda-graph" if cuda and many else "eager"
    if mode == "cuda-graph" and not cuda:
        raise ConfigError("--decode-step cuda-graph needs a CUDA device (use 'static' to run the fixed-shape step)")
    return mode


class StaticDecodeStep:
    """Decode steps over one cache with fixed shapes (see module doc): ``step(tokens [b, 1])``
    writes the next slot, advances ``cache.length`` and returns ``[b, 1, vocab]`` fp32 logits."""

    @torch.inference_mode()
    def __init__(self, engine, cache, graph: bool):
        if cache.length >= cache.max_length:
            raise ConfigError(f"the cache is full ({cache.max_length} positions): no decode step left")
        if graph and engine.device.type != "cuda":
            raise ConfigError("a CUDA graph needs the model on a CUDA device")
        self.engine, self.cache = engine, cache
        self.tokens = torch.zeros(cache.batch, 1, dtype=torch.long, device=engine.device)
        """Static input: the tokens of the step."""
        self.slot = torch.full((1,), cache.length, dtype=torch.long, device=engine.device)
        """Static input: the slot the step writes (``cache.length`` when it runs)."""
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: Tensor | None = None
        """Static output of the graph."""
        if graph:
            self._capture()

    @property
    def captured(self) -> bool:
        """Whether steps replay a CUDA graph."""
        return self.graph is not None

    def drop_graph(self) -> None:
        """Run the fixed-shape step eagerly from now on."""
        self.graph, self.logits = None, None

    def _capture(self) -> None:
        device = self.engine.device
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(WARMUP_STEPS):
                self.engine.decode_step(self.tokens, self.cache, self.slot)
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                logits = self.engine.decode_step(self.tokens, self.cache, self.slot)
        except RuntimeError as error:
            warnings.warn(f"CUDA graph capture of the decode step failed ({error}); running the step without a graph")
            return
        self.graph, self.logits = graph, logits

    @torch.inference_mode()
    def __call__(self, tokens: Tensor) -> Tensor:
        cache = self.cache
        if cache.length >= cache.max_length:
            raise ConfigError(f"sequence of {cache.length + 1} positions exceeds the cache's {cache.max_length}")
        # [b, 1] into the static buffer; the write slot as a device value (a fill kernel, no sync)
        self.tokens.copy_(tokens)
        self.slot.fill_(cache.length)
        if self.graph is None:
            logits = self.engine.decode_step(self.tokens, cache, self.slot)
        else:
            self.graph.replay()
            logits = self.logits
        cache.length += 1
        return logits
