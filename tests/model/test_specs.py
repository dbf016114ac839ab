"""Layer specs: roles, per-stage slicing, and the Transformer Engine spec tree (built without TE)."""

import sys

import pytest

from megatron.core.transformer.identity_op import IdentityOp

from epas_megatron.errors import ConfigError
from epas_megatron.model.attention import ComputingAttention, SharedAttention
from epas_megatron.model.specs import LOCAL, TRANSFORMER_ENGINE, decoder_layer_specs, layer_roles, layer_spec

TE = "megatron.core.extensions.transformer_engine"


def test_roles():
    assert layer_roles(4, ()) == ["compute"] * 4
    assert layer_roles(4, (2, 3)) == ["compute", "source", "share", "share"]
    with pytest.raises(ConfigError, match="last layer"):
        layer_roles(4, (1, 2))
    with pytest.raises(ConfigError, match="no source"):
        layer_roles(4, (0, 1, 2, 3))


def test_te_spec_names_te_classes_by_import_path_without_importing_te():
    before = "transformer_engine" in sys.modules
    share = layer_spec("share", TRANSFORMER_ENGINE)
    source = layer_spec("source", TRANSFORMER_ENGINE)
    assert ("transformer_engine" in sys.modules) == before  # building specs imported nothing
    attn = share.submodules.self_attention
    assert attn.module is SharedAttention and attn.params["share"] == "qk"
    assert attn.submodules.linear_own.module == (TE, "TELayerNormColumnParallelLinear")  # V projection fuses the norm
    assert attn.submodules.linear_frozen.module == (TE, "TEColumnParallelLinear")
    assert attn.submodules.core_attention.module == (TE, "TEDotProductAttention")
    assert attn.submodules.linear_proj.module == (TE, "TERowParallelLinear")
    assert share.submodules.input_layernorm is IdentityOp
    assert share.submodules.sharded_state_dict_keys_map == {
        "self_attention.linear_v.layer_norm_": "self_attention.linear_qkv.layer_norm_"}
    src = source.submodules.self_attention
    assert src.module is ComputingAttention and src.params["hand_off"] == "qk"
    assert src.submodules.linear_qkv.module == (TE, "TELayerNormColumnParallelLinear")
    assert source.submodules.sharded_state_dict_keys_map == {}
    fc1 = source.submodules.mlp.keywords["submodules"].linear_fc1
    assert fc1.module == (TE, "TELayerNormColumnParallelLinear")


def test_local_spec_classes_and_checkpoint_key_map():
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear

    share = layer_spec("share", LOCAL, share="kv")
    attn = share.submodules.self_attention
    assert attn.params["share"] == "kv"
    assert attn.submodules.linear_own is ColumnParallelLinear
    assert share.submodules.input_layernorm is LOCAL.norm
    # Local and TE layers save norms under the same keys.
    assert share.submodules.sharded_state_dict_keys_map["input_layernorm."] == "self_attention.linear_qkv.layer_norm_"


def test_decoder_specs_follow_roles():
    specs = decoder_layer_specs(6, (4, 5))
    kinds = [s.submodules.self_attention.module.__name__ for s in specs]
    assert kinds == ["ComputingAttention"] * 4 + ["SharedAttention"] * 2
    assert [s.submodules.self_attention.params.get("hand_off") for s in specs[:4]] == [None, None, None, "qk"]
