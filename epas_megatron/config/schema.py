"""The run configuration: one dataclass per concern, one docstring per field.

Every field is also a command-line flag (``train_iters`` -> ``--train-iters``), a key of the
YAML config file (under its section: ``training: {train_iters: 100}``), and is written to the
run's ``config.yaml``. Field names are unique across sections so flags stay flat. The help text
of each flag is the docstring under the field (read by :mod:`epas_megatron.config.cli`).

Validation that needs several sections at once lives in :mod:`epas_megatron.validation`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Optional


@dataclass
class ModelConfig:
    """LLaMA-architecture decoder (RMSNorm, SwiGLU, RoPE, GQA, no biases)."""

    preset: Optional[str] = None
    """Model preset (tiny, small, 125m, 350m, 1b, 3b, 7b). Preset values are defaults that any
    other model flag overrides."""

    num_layers: int = 4
    """Number of decoder layers."""

    hidden_size: int = 64
    """Hidden size h."""

    num_attention_heads: int = 4
    """Number of query heads."""

    num_query_groups: Optional[int] = None
    """Number of key/value heads (GQA). Default: equal to --num-attention-heads (MHA)."""

    ffn_hidden_size: Optional[int] = None
    """SwiGLU inner size. Default: 8/3 * hidden rounded up to a multiple of 256 (LLaMA)."""

    vocab_size: Optional[int] = None
    """Vocabulary size. Default: the tokenizer's."""

    max_position_embeddings: Optional[int] = None
    """Longest sequence the model supports. Default: --seq-length."""

    rotary_base: int = 10000
    """RoPE base period."""

    norm_epsilon: float = 1e-5
    """RMSNorm epsilon."""

    init_method_std: float = 0.02
    """Standard deviation of the normal weight initialisation."""

    untie_embeddings_and_output_weights: bool = True
    """Untied input embeddings and LM head (LLaMA). --no-untie-embeddings-and-output-weights ties
    them."""

    moc_topk: float = 1.0
    """Mixture-of-Channels (Wu et al., arXiv 2511.09323): the fraction of SwiGLU channels each
    token keeps (Top-K of the gate pre-activation within --moc-groups groups); the MLP stores only
    those for backward. 1 = the dense MLP; the paper uses about 0.2. Local layers only."""

    moc_groups: int = 8
    """Mixture-of-Channels: equal groups of the --ffn-hidden-size channels, each keeping its own
    Top-K; a multiple of --tp (no group straddles a tensor-parallel shard)."""

    transformer_impl: str = "auto"
    """Layer backend: 'local' (pure PyTorch Megatron-Core modules, runs everywhere),
    'transformer_engine' (GPU only), or 'auto' (TE when CUDA and TE are present, else local)."""

    core_attention: str = "sdpa"
    """Attention kernel of local layers: 'sdpa' (PyTorch scaled_dot_product_attention:
    FlashAttention / memory-efficient kernels on GPU, fused on CPU; no s x s scores kept) or
    'unfused' (Megatron-Core's DotProductAttention, which materialises the scores). Transformer
    Engine layers always use TE's fused attention."""


@dataclass
class ParallelConfig:
    """Tensor, pipeline and data parallelism, and activation recompute."""

    tp: int = 1
    """Tensor-parallel size."""

    pp: int = 1
    """Pipeline-parallel size."""

    vpp: Optional[int] = None
    """Virtual pipeline stages (model chunks) per pipeline rank (interleaved 1F1B)."""

    pipeline_schedule: Optional[str] = None
    """Pipeline schedule: '1f1b' or 'interleaved' (Megatron-Core's), or 'v-1f1b' (V placement: rank
    r holds the (r+1)-th and the (2p-r)-th of 2p stages, embedding and loss on rank 0, run by the
    project's executor), 'v-half' and 'v-min' (V placement with the weight-gradient backward
    deferred: about half and a third of 1F1B's activation memory; local layers). Default: interleaved with --vpp or an
    interleaved --pipeline-layout, else 1f1b."""

    pipeline_layout: Optional[str] = None
    """Explicit Megatron-Core pipeline layout, e.g. 'Ettt|tttL' ('E' embedding, 't' decoder
    layer, 'L' loss, '|' stage boundary). Under a V schedule a V layout: 'V:' and the 2 x --pp
    stages in V order (stage s on rank s and on rank 2p-1-s), e.g. 'V:Ett|t|t|ttL' at --pp 2
    ('L' closes the last stage, on rank 0). Default: even split (rebalanced at EPAS switches)."""

    sequence_parallel: bool = False
    """Sequence parallelism: norms and dropout work on a 1/TP slice of the sequence (needs TP > 1)."""

    use_distributed_optimizer: Optional[bool] = None
    """Shard optimizer state (and fp32 main weights) over data-parallel ranks. Default: on with
    CUDA, off on CPU (where it runs too, over gloo)."""

    overlap_grad_reduce: bool = False
    """Overlap the data-parallel gradient reduction with the backward pass."""

    recompute: str = "none"
    """Activation recompute: 'none', 'selective' (the modules of --recompute-modules) or 'full'."""

    recompute_modules: Optional[list[str]] = None
    """With --recompute selective: the parts of each layer Megatron-Core recomputes in backward --
    'core_attn' (the attention kernel), 'mlp' (the whole SwiGLU MLP: it keeps only its input).
    Default: core_attn."""

    recompute_method: str = "uniform"
    """With --recompute full: 'uniform' (chunks of --recompute-num-layers) or 'block' (the first
    --recompute-num-layers layers of each stage)."""

    recompute_num_layers: int = 1
    """With --recompute full: layers per recompute chunk (uniform) or recomputed layers (block)."""


@dataclass
class TrainingConfig:
    """Optimisation and schedule."""

    train_iters: int = 100
    """Number of training iterations (optimizer steps)."""

    micro_batch_size: int = 4
    """Sequences per micro-batch per data-parallel rank."""

    global_batch_size: Optional[int] = None
    """Sequences per iteration over all data-parallel ranks. Default: micro batch x DP."""

    seq_length: int = 128
    """Training sequence length in tokens."""

    lr: float = 3e-4
    """Peak learning rate."""

    min_lr: float = 3e-5
    """Final learning rate of the decay."""

    lr_warmup_iters: int = 10
    """Linear warm-up iterations."""

    lr_decay_style: str = "cosine"
    """Learning-rate decay after warm-up: 'cosine', 'linear' or 'constant'."""

    weight_decay: float = 0.1
    """AdamW decoupled weight decay (not applied to norms; never to frozen Q/K)."""

    adam_beta1: float = 0.9
    """AdamW beta1."""

    adam_beta2: float = 0.95
    """AdamW beta2."""

    adam_eps: float = 1e-8
    """AdamW epsilon."""

    clip_grad: float = 1.0
    """Clip the global gradient norm to this value (0 disables)."""

    seed: int = 1234
    """Random seed (weights, data order, dropout)."""

    precision: str = "auto"
    """'bf16', 'fp16' (with loss scaling; the paper's V100 setting), 'fp32', or 'auto' (bf16 with
    CUDA, fp32 on CPU). bf16/fp16 keep fp32 main weights in the optimizer; on CPU they run
    (slowly) for checks."""

    loss_scale: Optional[float] = None
    """fp16: a static loss scale (a power of 2). Default: dynamic loss scaling."""

    initial_loss_scale: float = 2.0**15
    """fp16, dynamic loss scaling: the initial scale. Per-token losses are summed over a
    micro-batch (not averaged, as Megatron-LM's default), so the scale settles about
    tokens-per-micro-batch times lower for the same fp16 gradients; a logit's gradient alone
    reaches the scale, and fp16 overflows above 65504, so the search starts at 2^15 rather than
    Megatron-LM's 2^32."""

    min_loss_scale: float = 1.0
    """fp16, dynamic loss scaling: the smallest scale."""

    loss_scale_window: int = 1000
    """fp16, dynamic loss scaling: steps without overflow before the scale doubles."""

    hysteresis: int = 2
    """fp16, dynamic loss scaling: overflowing steps tolerated before the scale halves."""

    deterministic: bool = False
    """Deterministic GPU kernels, so that reruns and resumes are bit-identical on the same GPUs
    (PyTorch's deterministic algorithms, cuBLAS workspace config, Megatron's and Transformer
    Engine's deterministic mode, NCCL without NVLS); slower. CPU runs are deterministic anyway."""

    eval_interval: int = 50
    """Compute validation loss every this many iterations (0 disables)."""

    eval_iters: int = 4
    """Validation micro-batch rounds per evaluation."""

    eval_regions: Optional[str] = None
    """Also evaluate the same weights at other sharing regions at every --eval-interval:
    comma-separated region sizes ('0,2'), 'half' (half the region in training) and 'max' (the
    region in training), e.g. '0,half,max'. A size larger than the region in training is skipped
    until the region has grown to it (its layers never trained in sharing mode) unless
    --eval-untrained-regions. One validation series per region goes to metrics.jsonl
    ("kind": "valid", "region": R), TensorBoard and wandb (valid/region_R/lm_loss). Training is
    unaffected (same losses with and without)."""

    eval_untrained_regions: bool = False
    """With --eval-regions: also evaluate regions larger than the one in training (inference-time
    sharing on layers that never trained in sharing mode, the paper's baseline)."""

    exit_interval: Optional[int] = None
    """Save and stop after this many iterations of this run (for tests and preemption drills)."""


EMBEDDED_DATA = "embedded"
"""``--data embedded``: the embedded corpus, asked for by name (what a model larger than the
``small`` preset needs to train on it: :func:`~epas_megatron.validation.resolve_run`)."""


@dataclass
class DataConfig:
    """Training data and tokenizer."""

    data: Optional[list[str]] = None
    """Megatron indexed dataset prefixes (path/to/name for name.bin + name.idx, from
    tools/preprocess_data.py), optionally weighted: '0.7 a 0.3 b'; or 'embedded'. Default (and
    'embedded'): the embedded corpus (standard-library documentation, about 0.44M training
    tokens), tokenized and cached on first use. A model larger than the 'small' preset stops
    without --data (it would see that corpus thousands of times); '--data embedded' runs it
    anyway."""

    split: str = "969,30,1"
    """Train/valid/test split weights of the documents."""

    tokenizer_model: Optional[str] = None
    """SentencePiece model file (e.g. LLaMA's tokenizer.model). Default: one trained on the
    embedded corpus with --default-vocab-size pieces."""

    default_vocab_size: int = 4096
    """Vocabulary of the tokenizer trained on the embedded corpus."""

    data_cache_dir: Optional[str] = None
    """Where the embedded corpus, its tokenizer and dataset index caches go. Default:
    $EPAS_CACHE_DIR or ~/.cache/epas_megatron."""

    @property
    def embedded(self) -> bool:
        """The run reads the embedded corpus (no --data, or --data embedded)."""
        return self.data is None or list(self.data) == [EMBEDDED_DATA]


@dataclass
class CheckpointConfig:
    """Distributed checkpoints (megatron.core.dist_checkpointing)."""

    save: Optional[str] = None
    """Checkpoint directory. Default: <output-dir>/checkpoints."""

    load: Optional[str] = None
    """Resume from this checkpoint directory (its latest checkpoint, or a given iter_NNNNNNN).
    A directory that does not exist, or holds no checkpoint, is an error -- except the run's own
    checkpoint directory (<output-dir>/checkpoints or --save), where it means a first start (as
    the Slurm script's first job): the run starts from scratch and says so."""

    load_fallback: bool = False
    """With --load: if the checkpoint to resume is damaged (run_meta.json unreadable, a data
    file missing or truncated), resume from the newest older checkpoint in the same directory
    that is whole, naming each one skipped and why. Without it a damaged checkpoint is an
    error."""

    pretrained: Optional[str] = None
    """Start from the model weights of this checkpoint (root or iter_ directory) with a fresh
    optimizer, LR schedule and iteration 0: continual pretraining, e.g. of a Hugging Face model
    imported with `epas-convert hf-import`. Ignored when --load holds a checkpoint (resume)."""

    save_interval: Optional[int] = None
    """Save every this many iterations (also at the end and on an exit signal)."""

    keep_last: int = 2
    """Keep this many most recent checkpoints (0 keeps all)."""

    save_final: bool = True
    """Save a checkpoint at the end of training (--no-save-final: do not; a run stopped early by
    a signal or an exit condition still saves)."""

    async_save: bool = False
    """Write checkpoints in the background while training continues (Megatron-Core's
    asynchronous torch_dist writer, one forked writer process per rank). The latest pointer
    moves only once every rank has finished writing; a save still in flight is completed before
    the next save and at the end of training. Switch staging saves (--epas-switch-mode
    checkpoint) stay synchronous."""


@dataclass
class LoggingConfig:
    """Console, metrics.jsonl, TensorBoard and wandb."""

    output_dir: str = "runs/default"
    """Run directory: config.yaml, metrics.jsonl, checkpoints/, tensorboard/."""

    log_interval: int = 10
    """Print and record metrics every this many iterations."""

    tensorboard: bool = True
    """Write TensorBoard events under <output-dir>/tensorboard."""

    wandb: bool = False
    """Log to Weights & Biases (WANDB_MODE=offline works without network)."""

    wandb_project: str = "epas-megatron"
    """wandb project name."""

    wandb_run_name: Optional[str] = None
    """wandb run name. Default: the output directory's name."""

    peak_tflops: Optional[str] = None
    """Accelerator for MFU: a100, h100, h200, ... Default: detected from the GPU name; CPU has
    none (MFU printed as n/a)."""


@dataclass
class EpasConfig:
    """EPAS: progressive QK sharing (see docs/method.md)."""

    epas_target_layers: str = "0"
    """Deepest layers that will share Q/K at the end of the schedule: a count ('6') or a
    fraction of the layers ('0.5'). 0 disables EPAS."""

    epas_interval: int = 100
    """Iterations between switches (I in the paper)."""

    epas_growth: int = 1
    """Layers that switch to sharing at each switch (B in the paper); must divide the target."""

    epas_first_switch: Optional[int] = None
    """Iteration of the first switch. Default: --epas-interval (the paper's Algorithm 1)."""

    epas_exclude_last: int = 0
    """Deepest layers that never share: the sharing region ends at layer num_layers - 1 - N
    and the N layers after it compute their own Q/K. 0 (the paper's default) includes the last
    layer, which the paper's ablation found better (+1.2 avg); N > 0 reproduces that ablation.
    The region still grows from its end toward shallower layers, and at most
    num_layers - 1 - N layers can be targets (a source must remain before the region)."""

    epas_blocks: int = 1
    """Sharing blocks the target region is split into (the paper's "one block vs several"
    ablation). 1 (the paper's method) is one block at the deep end; K > 1 splits the target into
    K equal blocks, each at the deep end of its 1/K of the depth with its own source layer before
    it (the deepest still ends where one block would), growing round-robin, deepest block first.
    K must divide the target, and the target plus K must not exceed num_layers - N."""

    epas_share: str = "qk"
    """What sharing layers reuse from the source layer: 'qk' (the paper: own V) or 'kv'
    (own Q, source's K and V; CLA-like)."""

    epas_detach_shared: bool = False
    """Stop gradients of sharing layers from flowing into the source layer's Q/K (the paper
    lets them flow: off)."""

    epas_rebalance: str = "auto"
    """Re-partition pipeline stages at every switch: 'on', 'off', or 'auto' (on when PP > 1
    and no explicit --pipeline-layout). Under a V schedule the 2 x --pp V stages are rebalanced
    (without a memory budget)."""

    epas_cost_model: str = "flops"
    """Layer costs the rebalancing planner uses: 'flops' (sharing-aware FLOPs model) or
    'measured' (forward times of computing layers, sharing layers and the LM head timed in the
    running model for --epas-cost-timing-iters iterations after each rebuild; kinds not measured
    yet keep their FLOPs cost)."""

    epas_cost_timing_iters: int = 3
    """Iterations timed after each (re)build with --epas-cost-model measured."""

    epas_memory_budget_gb: Optional[float] = None
    """Per-GPU memory budget (GiB) for stage rebalancing: among pipeline layouts whose every
    rank fits (weights, gradients, Adam state, activations of the in-flight micro-batches, from
    the memory model), the planner picks the fastest, and says when the FLOP-optimal layout
    would not have fitted. Default: 90 percent of the GPU's memory on CUDA, none on CPU. Needs
    --recompute none or selective."""

    epas_switch_mode: str = "memory"
    """How a switch carries the training state from the old region's modules, DDP buffers and
    optimizer to the new ones: 'memory' (moved in memory; layers that change pipeline stage go
    point to point between ranks; nothing is written) or 'checkpoint' (a full distributed
    checkpoint saved to <output-dir>/.switch_staging and loaded back). Both are exact and give
    bit-identical runs; 'memory' is faster and writes nothing."""

    epas_switch_rewarm: int = 0
    """Learning-rate re-warm after each switch: the N steps from a switch at iteration t run
    with the scheduler's LR times (k+1)/(N+1) at iteration t+k (k = 0..N-1), back to the
    scheduler's LR at t+N; every parameter group, on top of any LR schedule (also Random-LTD's
    LayerToken LR). 0: off. Must be smaller than --epas-interval. A pure function of the
    iteration and the schedule (resumes continue it exactly; stored in checkpoints, a resume
    with another value is refused). Costs no FLOPs: the same steps run on the same tokens.
    The logged lr of iteration i is, as always, the LR the step of i+1 uses."""

    epas_switch_ramp: int = 0
    """Blended switches: over the N steps before each switch at iteration t, the layers that
    switch at t attend with (1 - a) * their own post-RoPE Q/K + a * the incoming hand-off's
    (their source's), a = 1/N, 2/N, ..., 1 at iteration t-N .. t-1, and hand the blend on; the
    switch at t then changes the forward pass by nothing. 0: off. Must be smaller than
    --epas-interval and than --epas-first-switch. Costs two multiply-adds per blended Q/K
    element (the layers compute their Q/K then anyway); the switches stay at their iterations.
    Needs --pp 1 and no --random-ltd. A pure function of the iteration and the schedule
    (resumes continue it exactly; stored in checkpoints, a resume with another value is refused)."""


@dataclass
class RandomLTDConfig:
    """Random-LTD (random layerwise token dropping, Yao et al. 2022; DeepSpeed Data Efficiency's
    schedule and names): in training, the chosen layers process a random subset of each
    sequence's tokens, the kept count growing linearly over training; composes with EPAS (see
    docs/random-ltd.md)."""

    random_ltd: bool = False
    """Drop tokens in the --random-ltd-layers during training (evaluation keeps every token)."""

    random_ltd_layers: Optional[str] = None
    """Layers that drop tokens, 0-based ids and ranges ('1-10', '1,3,5-7'). Default: every
    layer but the first and the last (DeepSpeed's GPT examples). A layer that hands Q/K on to an
    EPAS sharing region computes Q/K for every token and the rest for its kept tokens."""

    random_ltd_min_value: Optional[int] = None
    """Tokens kept at the first iteration (DeepSpeed's min_value). Default: 1/16 of
    --seq-length, a multiple of --random-ltd-seq-per-step."""

    random_ltd_max_value: Optional[int] = None
    """Tokens kept at the end of the ramp (max_value). Default: --seq-length (no dropping from
    then on)."""

    random_ltd_require_steps: Optional[int] = None
    """Iterations over which the kept count ramps linearly from min to max (require_steps).
    Default: 70 percent of --train-iters."""

    random_ltd_seq_per_step: Optional[int] = None
    """Kept counts are multiples of this (seq_per_step). Default: 16, or --seq-length / 16 for
    sequences under 256 tokens."""

    random_ltd_layer_token_lr: bool = True
    """LayerToken learning rate: the LR schedule advances by the layer tokens each iteration
    processes, so it decays more slowly while few tokens are kept, and still peaks after
    --lr-warmup-iters and ends at --min-lr after --train-iters."""

    random_ltd_kernels: str = "auto"
    """Token gather/scatter: 'torch' (PyTorch ops, every device), 'deepspeed' (DeepSpeed's
    Random-LTD CUDA kernels), or 'auto' (DeepSpeed's on CUDA when they load)."""


ENROLLED_SECTIONS: dict[str, type] = {}
"""Config sections of build options beyond the built-in ones, by name
(:func:`epas_megatron.config.sections.enrol_section`)."""


def _enrolled_defaults() -> dict[str, Any]:
    return {name: cls() for name, cls in ENROLLED_SECTIONS.items()}


@dataclass
class RunConfig:
    """Everything a run needs; sections mirror the YAML file."""

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    epas: EpasConfig = field(default_factory=EpasConfig)
    random_ltd: RandomLTDConfig = field(default_factory=RandomLTDConfig)
    enrolled: dict[str, Any] = field(default_factory=_enrolled_defaults, repr=False)
    """The sections of enrolled build options (:data:`ENROLLED_SECTIONS`), read as attributes
    (``cfg.<name>``) like the built-in ones."""

    def __getattr__(self, name: str) -> Any:
        # Only reached for names that are not attributes: an enrolled section (a config made
        # before its option was enrolled gets the section's defaults).
        if name in ENROLLED_SECTIONS:
            return self.__dict__.setdefault("enrolled", {}).setdefault(name, ENROLLED_SECTIONS[name]())
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")


SECTIONS: dict[str, type] = {f.name: f.default_factory for f in fields(RunConfig) if f.name != "enrolled"}
"""The built-in sections, by name."""
