"""What a run starts from and where its checkpoints go, resolved from ``--load``, ``--pretrained``,
``--save`` and ``--output-dir`` before any work starts: the checkpoint to resume (whole, or the
newest whole one before a damaged one with ``--load-fallback``), refused when it holds another
model or an optimizer state of the other format, and a run directory that already holds a run
refused (:func:`resolve_sources`, called by :func:`epas_megatron.validation.resolve_run`)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from epas_megatron.checkpointing.metadata import MODEL_FIELD_DEFAULTS, CheckpointMeta, model_record
from epas_megatron.config.cli import flag_name
from epas_megatron.config.schema import RunConfig
from epas_megatron.errors import ConfigError


def model_shape_differences(saved: dict, current: dict) -> list[str]:
    """Model fields that differ between a checkpoint and this run (vocab may be unresolved)."""
    diffs = []
    for key, value in current.items():
        if value is None:
            continue
        if key not in saved and key in MODEL_FIELD_DEFAULTS:
            saved = {**saved, key: MODEL_FIELD_DEFAULTS[key]}
        if key == "moc_groups" and saved.get("moc_topk", 1.0) == current.get("moc_topk") == 1.0:
            continue  # dense either way: the groups do not matter
        if key in saved and saved[key] != value:
            diffs.append(f"{flag_name(key)}: checkpoint {saved[key]}, this run {value}")
    return diffs


def resolve_sources(cfg: RunConfig, use_dist_opt: bool) -> dict:
    """Where checkpoints go and what the run starts from (reads checkpoint metadata, checks the
    checkpoint is whole): the ``checkpoint_root``, ``load_dir``/``load_meta``, ``pretrained_dir``
    and ``notices`` fields."""
    from epas_megatron.checkpointing.integrity import open_checkpoint

    out = Path(cfg.logging.output_dir)
    ckpt_root = Path(cfg.checkpoint.save) if cfg.checkpoint.save else out / "checkpoints"
    load_dir, load_meta, notices = None, None, []
    if cfg.checkpoint.load:
        load_dir, load_meta, notices = resolve_load(Path(cfg.checkpoint.load), ckpt_root, cfg.checkpoint.load_fallback)
        if load_meta is not None:
            check_same_model(load_meta, cfg, f"--load {cfg.checkpoint.load}")
            saved_dist = load_meta.parallel.use_distributed_optimizer if load_meta.parallel is not None else None
            if load_meta.has_optimizer_state and saved_dist is not None and saved_dist != use_dist_opt:
                flag = "--use-distributed-optimizer" if saved_dist else "--no-use-distributed-optimizer"
                raise ConfigError(
                    f"--load {cfg.checkpoint.load}: its optimizer state was saved {'with' if saved_dist else 'without'} the distributed "
                    f"optimizer, whose formats differ; resume with {flag} (or start from its weights with --pretrained)")
    elif cfg.checkpoint.load_fallback:
        raise ConfigError("--load-fallback applies to --load; give the checkpoint directory to resume")
    pretrained_dir = None
    if cfg.checkpoint.pretrained and load_dir is None:
        pretrained_dir, pretrained_meta = open_checkpoint(cfg.checkpoint.pretrained, "--pretrained")
        check_same_model(pretrained_meta, cfg, f"--pretrained {cfg.checkpoint.pretrained}")
    if not cfg.checkpoint.load and (out / "config.yaml").exists():
        raise ConfigError(f"--output-dir {out} already holds a run (config.yaml); "
                          f"resume it with --load {ckpt_root} or choose another --output-dir")
    if cfg.checkpoint.keep_last < 0:
        raise ConfigError(f"--keep-last must be >= 0, got {cfg.checkpoint.keep_last}")
    return dict(checkpoint_root=ckpt_root, load_dir=load_dir, load_meta=load_meta, pretrained_dir=pretrained_dir,
                notices=tuple(notices))


def resolve_load(load_path: Path, ckpt_root: Path, fallback: bool) -> tuple[Optional[Path], Optional[CheckpointMeta], list[str]]:
    """(checkpoint to resume, its metadata, notices) for ``--load``: None, None for a first start
    in the run's own checkpoint directory; a whole checkpoint otherwise, or the newest whole one
    before a damaged one with ``--load-fallback``."""
    from epas_megatron.checkpointing.checkpoint import read_checkpoint_meta, resolve_checkpoint
    from epas_megatron.checkpointing.integrity import checkpoint_problem, newest_sound_checkpoint

    own_root = load_path.resolve() == ckpt_root.resolve()
    if load_path.exists() and not load_path.is_dir():
        raise ConfigError(f"--load {load_path}: not a directory")
    checkpoint = resolve_checkpoint(load_path) if load_path.exists() else None
    if checkpoint is None:
        if own_root:  # the run's own directory before its first save (a Slurm job's first start)
            return None, None, [f"--load {load_path}: no checkpoint there yet (the run's own checkpoint directory); starting from scratch"]
        what = "no checkpoint there" if load_path.exists() else "no such directory"
        raise ConfigError(f"--load {load_path}: {what}")
    problem = checkpoint_problem(checkpoint)
    if problem is None:
        return checkpoint, read_checkpoint_meta(checkpoint), []
    if not fallback:
        raise ConfigError(f"--load {load_path}: checkpoint {checkpoint.name} is damaged: {problem}; "
                          "--load-fallback resumes from the newest older checkpoint that is whole")
    root = checkpoint.parent
    iteration = int(checkpoint.name[5:]) if checkpoint.name[5:].isdigit() else -1
    found, skipped = newest_sound_checkpoint(root, iteration)
    notices = [f"--load-fallback: skipped {line}" for line in skipped]
    if found is None:
        raise ConfigError(f"--load {load_path}: no checkpoint in {root} is whole ({'; '.join(skipped)})")
    notices.append(f"--load-fallback: resuming from {found} instead")
    return found, read_checkpoint_meta(found), notices


def check_same_model(meta: CheckpointMeta, cfg: RunConfig, source: str) -> None:
    """Refuse a checkpoint of another model shape (the vocabulary named on its own: the tokenizer
    flag to pass)."""
    diffs = model_shape_differences(meta.model, model_record(cfg.model))
    vocab = [d for d in diffs if d.startswith("--vocab-size")]
    if vocab and len(diffs) == 1:
        saved = meta.model["vocab_size"]
        raise ConfigError(f"{source}: the checkpoint's vocabulary is {saved}, this run's is {cfg.model.vocab_size}; "
                          "pass the --tokenizer-model (or --vocab-size) it was trained with")
    if diffs:
        raise ConfigError(f"{source}: the checkpoint holds a different model ({'; '.join(diffs)})")
