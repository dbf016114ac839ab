"""``epas-convert``: Hugging Face LLaMA <-> epas-megatron distributed checkpoints.

    epas-convert hf-import --hf-dir TinyLlama-1.1B --output ckpts/tinyllama
    epas-train --preset 1b --pretrained ckpts/tinyllama --tokenizer-model ckpts/tinyllama/tokenizer.model \\
               --data data/corpus --epas-target-layers 5 ...          # continual pretraining with EPAS
    epas-convert hf-export --load runs/x/checkpoints --output hf/x       # any sharing region -> plain LLaMA
    epas-convert hf-export --load runs/x/checkpoints --output hf/x-epas --region max   # EPAS for transformers

Without ``--region`` the export is a plain ``LlamaForCausalLM`` (region 0: every sharing layer's
frozen Q/K rows fused back). With ``--region R`` (an int up to the trained region, or 'max') it
is an ``EpasLlamaForCausalLM`` whose last R layers (where the checkpoint's regions end) share:
config (``model_type='epas_llama'``, the sharing layers, the share kind), the modeling,
configuration, cache and tokenizer code of :mod:`epas_megatron.hf` copied next to safetensors
weights (``auto_map``; loads with ``trust_remote_code=True``, offline), the sharing layers'
frozen rows as ``frozen_*_proj`` (so any region 0..R runs), and a ``tokenizer_config.json`` for
the copied ``tokenizer.model``. ``hf-import`` reads either kind; an EPAS directory comes back as
a checkpoint saved at its region (``sharing_layers`` and ``epas_share`` in its metadata, so
``epas-eval`` and ``epas-generate`` default to it).

A Mixture-of-Channels model (``--moc-topk < 1``; Wu et al., arXiv 2511.09323) always exports as
an ``EpasLlamaForCausalLM`` (region 0 without ``--region``): its config records ``moc_topk`` and
``moc_groups`` and its MLPs keep the same Top-K gate channels (a stock ``LlamaForCausalLM`` on
these weights would be a dense model, another model). ``hf-import`` reads them back into the
checkpoint's model fields.

Both run as one process (whole tensors, TP=1/PP=1); the checkpoint then loads into any layout.
Import checks what the architecture supports (no RoPE scaling, no biases, SiLU). The vocabulary
is padded to a multiple of 128 inside the checkpoint and cut back on export. A ``tokenizer.model``
found next to the weights is copied along. Needs ``transformers`` (``pip install .[hf]``).
"""

from __future__ import annotations

import argparse
import shutil
import sys
from dataclasses import replace
from pathlib import Path
from typing import Optional, Sequence

from epas_megatron.errors import ConfigError
from epas_megatron.model.moc_sizes import MoCSettings
from epas_megatron.sharing.shape import RegionShape


def _model_config_from_hf(hf_config):
    from epas_megatron.config.schema import ModelConfig

    rope = getattr(hf_config, "rope_scaling", None) or getattr(hf_config, "rope_parameters", None) or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise ConfigError(f"--hf-dir: RoPE scaling {rope} is not supported (plain RoPE only)")
    rope_theta = rope.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    if getattr(hf_config, "attention_bias", False) or getattr(hf_config, "mlp_bias", False):
        raise ConfigError("--hf-dir: attention/MLP biases are not supported (LLaMA has none)")
    if getattr(hf_config, "hidden_act", "silu") != "silu":
        raise ConfigError(f"--hf-dir: activation {hf_config.hidden_act!r} is not SwiGLU/SiLU")
    moc_topk = float(getattr(hf_config, "moc_topk", 1.0))  # an EPAS export of a Mixture-of-Channels model
    return ModelConfig(
        num_layers=hf_config.num_hidden_layers,
        hidden_size=hf_config.hidden_size,
        num_attention_heads=hf_config.num_attention_heads,
        num_query_groups=getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads,
        ffn_hidden_size=hf_config.intermediate_size,
        vocab_size=hf_config.vocab_size,
        max_position_embeddings=hf_config.max_position_embeddings,
        rotary_base=int(rope_theta),
        norm_epsilon=hf_config.rms_norm_eps,
        untie_embeddings_and_output_weights=not hf_config.tie_word_embeddings,
        transformer_impl="local",
        moc_topk=moc_topk,
        moc_groups=int(getattr(hf_config, "moc_groups", 8)) if moc_topk < 1.0 else 8,
    )


def hf_import(hf_dir: Path, output: Path) -> Path:
    """Hugging Face directory (plain LLaMA or an EPAS export) -> checkpoint root with iteration 0
    (model weights only; an EPAS export's region is the checkpoint's)."""
    import torch
    from transformers import AutoConfig, LlamaForCausalLM

    import epas_megatron.hf  # noqa: F401  (registers model_type 'epas_llama' with AutoConfig)
    from epas_megatron.assembly import checkpoint_meta_for_import, plan_for_checkpoint
    from epas_megatron.checkpointing.checkpoint import save_checkpoint
    from epas_megatron.config.schema import RunConfig
    from epas_megatron.convert.hf_llama import from_epas_hf, hf_to_megatron
    from epas_megatron.hf import EpasLlamaForCausalLM
    from epas_megatron.model.builder import build_model
    from epas_megatron.runtime.distributed import destroy_distributed, init_distributed

    hf_config = AutoConfig.from_pretrained(hf_dir)
    model_cfg = _model_config_from_hf(hf_config)
    epas = hf_config.model_type == "epas_llama"
    if epas:
        hf_state = from_epas_hf(EpasLlamaForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).state_dict())
        sharing, share = tuple(hf_config.epas_sharing_layers), hf_config.epas_share
    else:
        hf_state = LlamaForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32).state_dict()
        sharing, share = (), "qk"
    exclude_last = model_cfg.num_layers - 1 - sharing[-1] if sharing else 0
    blocks = _shape_of(hf_config.epas_region_order, model_cfg.num_layers, exclude_last, hf_dir).blocks if sharing else 1
    tokenizer = hf_dir / "tokenizer.model"
    cfg = replace(RunConfig(), model=model_cfg)
    cfg = replace(cfg, training=replace(cfg.training, seq_length=model_cfg.max_position_embeddings),
                  epas=replace(cfg.epas, epas_share=share, epas_exclude_last=exclude_last, epas_target_layers=str(len(sharing)),
                               epas_blocks=blocks))
    meta = checkpoint_meta_for_import(cfg, str(output / "tokenizer.model") if tokenizer.is_file() else None, str(hf_dir),
                                      sharing_layers=sharing, share=share)
    init_distributed(1, 1, None, seed=0)
    try:
        # fp32 local layers at the region it is saved with (the plain state dict loads into any region).
        plan = plan_for_checkpoint(meta, precision="fp32", backend="local", cuda=False)
        model = build_model(plan).chunks[0]
        model.load_state_dict(hf_to_megatron(hf_state, plan.arch), strict=False)
        output.mkdir(parents=True, exist_ok=True)
        if tokenizer.is_file():
            shutil.copy(tokenizer, output / "tokenizer.model")
        return save_checkpoint(output, 0, [model], None, None, {"iteration": 0}, meta.to_dict())
    finally:
        destroy_distributed()


def _shape_of(order, num_layers: int, exclude_last: int, hf_dir: Path) -> RegionShape:
    """The region shape whose regions grow in ``order`` (an export's ``epas_region_order``):
    the fewest blocks (``--epas-blocks``) with that switching order."""
    for blocks in range(1, len(order) + 1):
        try:
            shape = RegionShape(num_layers, exclude_last, blocks)
            if shape.order(len(order)) == tuple(order):
                return shape
        except ConfigError:
            continue
    raise ConfigError(f"--hf-dir {hf_dir}: epas_region_order {list(order)} is the order of no sharing region of one or "
                      "several blocks (--epas-blocks) ending at its deepest sharing layer")


def export_region(meta, text: str) -> int:
    """``--region``: an int from 0 to the checkpoint's trained region, or 'max' (that region)."""
    if text == "max":
        return meta.trained_region
    try:
        region = int(text)
    except ValueError:
        raise ConfigError(f"--region {text!r}: give a number of sharing layers or 'max'") from None
    if not 0 <= region <= meta.trained_region:
        raise ConfigError(f"--region {region}: must be between 0 and {meta.trained_region}, the sharing region this "
                          f"checkpoint was trained with (its frozen Q/K rows exist only up to there)")
    return region


def hf_export(load: Path, output: Path, region: Optional[str] = None) -> Path:
    """Checkpoint (any sharing region) -> Hugging Face directory: a plain ``LlamaForCausalLM``
    (``region`` None), or an ``EpasLlamaForCausalLM`` with ``region`` ('max' or an int up to the
    trained region) sharing layers -- always for a Mixture-of-Channels model, at region 0 when
    ``region`` is None (see the module notes)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from epas_megatron.assembly import plan_for_checkpoint
    from epas_megatron.checkpointing.checkpoint import load_checkpoint
    from epas_megatron.checkpointing.integrity import open_checkpoint
    from epas_megatron.convert.hf_llama import hf_config_kwargs, megatron_to_hf, strip_extra_state
    from epas_megatron.model.builder import build_model
    from epas_megatron.runtime.distributed import destroy_distributed, init_distributed

    checkpoint, meta = open_checkpoint(load, "--load", needs_config=True)
    size = None if region is None else export_region(meta, region)
    m = meta.run_config().model
    moc = MoCSettings.from_flags(m.moc_topk, m.moc_groups)
    if moc is not None and size is None:
        print(f"note: a Mixture-of-Channels model (--moc-topk {m.moc_topk}, --moc-groups {m.moc_groups}) exports as an "
              "EpasLlamaForCausalLM at region 0 (load it with trust_remote_code=True): a plain LlamaForCausalLM would "
              "run its MLPs dense", flush=True)
        size = 0
    init_distributed(1, 1, None, seed=0)
    try:
        # fp32 local layers at the trained region (the export keeps every layer's own Q/K).
        plan = plan_for_checkpoint(meta, precision="fp32", backend="local")
        model = build_model(plan).chunks[0]
        load_checkpoint(checkpoint, [model], restore_rng=False)
        hf_state = megatron_to_hf(strip_extra_state(model.state_dict()), plan.arch, m.vocab_size)
    finally:
        destroy_distributed()
    kwargs = hf_config_kwargs(plan.arch, m.vocab_size)
    if moc is not None:
        kwargs.update(moc_topk=float(moc.topk), moc_groups=int(moc.groups))
    if size is not None:
        return _write_epas(meta, kwargs, hf_state, size, output)
    config = LlamaConfig(**kwargs)
    hf = LlamaForCausalLM(config)
    hf.load_state_dict(hf_state, strict=not config.tie_word_embeddings)
    output.mkdir(parents=True, exist_ok=True)
    hf.save_pretrained(output, safe_serialization=True)
    tokenizer = meta.tokenizer_model
    if tokenizer and Path(tokenizer).is_file():
        shutil.copy(tokenizer, output / "tokenizer.model")
    return output


def _write_epas(meta, config_kwargs: dict, hf_state: dict, region: int, output: Path) -> Path:
    """The EPAS directory of ``hf-export --region``: config, shipped code, weights, tokenizer."""
    import json

    import epas_megatron.hf as epas_hf
    from epas_megatron.convert.hf_llama import to_epas_hf
    order = meta.shape.order(region, "--region")
    sharing = sorted(order)
    config = epas_hf.EpasLlamaConfig(**config_kwargs, epas_share=meta.epas_share, epas_sharing_layers=list(sharing),
                                     epas_region_order=order, epas_region=len(sharing))
    config.auto_map = dict(epas_hf.AUTO_MAP)
    model = epas_hf.EpasLlamaForCausalLM(config)
    model.load_state_dict(to_epas_hf(hf_state, sharing, meta.epas_share), strict=not config.tie_word_embeddings)
    output.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(output, safe_serialization=True)
    for name in epas_hf.SHIPPED_FILES:
        shutil.copy(epas_hf.SOURCE_DIR / name, output / name)
    tokenizer = meta.tokenizer_model
    if tokenizer and Path(tokenizer).is_file():
        shutil.copy(tokenizer, output / "tokenizer.model")
        (output / "tokenizer_config.json").write_text(json.dumps(_tokenizer_config(Path(tokenizer), config), indent=2) + "\n")
    return output


def _tokenizer_config(model_file: Path, config) -> dict:
    """``tokenizer_config.json`` for :class:`~epas_megatron.hf.tokenization_epas.EpasTokenizer`: the
    SentencePiece model's own unk / eos / pad pieces, no BOS (see that module)."""
    import sentencepiece

    from epas_megatron.hf import TOKENIZER_AUTO_MAP

    processor = sentencepiece.SentencePieceProcessor(model_file=str(model_file))
    piece = lambda i: processor.id_to_piece(i) if i >= 0 else None
    return {"tokenizer_class": "EpasTokenizer", "auto_map": TOKENIZER_AUTO_MAP, "unk_token": piece(processor.unk_id()),
            "eos_token": piece(processor.eos_id()), "pad_token": piece(processor.pad_id()), "bos_token": None,
            "model_max_length": config.max_position_embeddings, "clean_up_tokenization_spaces": False}


def main(argv: Optional[Sequence[str]] = None) -> int:
    from epas_megatron.compat.quiet import quiet_library_noise

    quiet_library_noise()
    parser = argparse.ArgumentParser(prog="epas-convert", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    imp = commands.add_parser("hf-import", help="Hugging Face LLaMA directory -> checkpoint (iteration 0)")
    imp.add_argument("--hf-dir", required=True, type=Path, help="directory with config.json and weights")
    imp.add_argument("--output", required=True, type=Path, help="checkpoint root to create")
    exp = commands.add_parser("hf-export", help="checkpoint -> Hugging Face LLaMA directory")
    exp.add_argument("--load", required=True, type=Path, help="checkpoint root or iter_ directory")
    exp.add_argument("--output", required=True, type=Path, help="directory to write")
    exp.add_argument("--region", default=None,
                     help="write an EPAS model for transformers (trust_remote_code) with this many sharing layers, up to "
                          "the trained region ('max': that region); default: a plain LlamaForCausalLM (region 0; a "
                          "Mixture-of-Channels model: the EPAS modeling code at region 0)")
    args = parser.parse_args(argv)
    try:
        if args.command == "hf-import":
            if not (args.hf_dir / "config.json").is_file():
                raise ConfigError(f"--hf-dir {args.hf_dir}: no config.json")
            if args.output.exists() and any(args.output.iterdir()):
                raise ConfigError(f"--output {args.output} is not empty")
            path = hf_import(args.hf_dir, args.output)
        else:
            path = hf_export(args.load, args.output, args.region)
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr, flush=True)
        return ConfigError.exit_code
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
