"""Layer specs: roles, per-stage slicing, and the Transformer Engine spec tree (built without TE)."""

import sys

import pytest

from megatron.core.transformer.identity_op import IdentityOp

from epas_megatron.errors import ConfigError
from epas_megatron.model.attention import ComputingAttention, FrozenProjection, SharedAttention
from epas_megatron.model.specs import LOCAL, TRANSFORMER_ENGINE, decoder_layer_specs, layer_spec
from epas_megatron.sharing.schedule import layer_modes

TE = "megatron.core.extensions.transformer_engine"


def test_roles():
    assert layer_modes(4, ()) == ["compute"] * 4
    assert layer_modes(4, (2, 3)) == ["compute", "source", "share", "share"]
    with pytest.raises(ConfigError, match="last layer"):
        layer_modes(4, (1, 2))
    with pytest.raises(ConfigError, match="no source"):
        layer_modes(4, (0, 1, 2, 3))


def _leaves(spec, path=""):
    """(path, value) for every slot of a spec tree (ModuleSpecs, submodule dataclasses, partials)."""
    import dataclasses
    from functools import partial

    from megatron.core.transformer.spec_utils import ModuleSpec

    if isinstance(spec, ModuleSpec) and isinstance(spec.module, tuple):
        yield path, ("import path", spec.module)
    elif isinstance(spec, ModuleSpec):
        yield path + ".module", spec.module
        yield path + ".params", spec.params
        if spec.submodules is not None:
            yield from _leaves(spec.submodules, path + ".submodules")
    elif isinstance(spec, partial):
        yield path + ".func", spec.func
        for key, value in spec.keywords.items():
            yield from _leaves(value, f"{path}.{key}")
    elif dataclasses.is_dataclass(spec):
        for f in dataclasses.fields(spec):
            yield from _leaves(getattr(spec, f.name), f"{path}.{f.name}")
    else:
        yield path, spec


@pytest.mark.parametrize("role", ["compute", "source", "share"])
@pytest.mark.parametrize("share", ["qk", "kv"])
def test_te_spec_differs_from_local_only_in_backend_classes(role, share):
    """The TE and local specs of a layer are the same tree except where the backend supplies a
    class; the TE classes are named by import path (building the spec imports no TE) and each
    name exists in Megatron-Core's TE extension module."""
    import importlib

    before = "transformer_engine" in sys.modules
    te_spec = dict(_leaves(layer_spec(role, TRANSFORMER_ENGINE, share=share)))
    assert ("transformer_engine" in sys.modules) == before  # building specs imported nothing
    local_spec = dict(_leaves(layer_spec(role, LOCAL, share=share)))
    extension = importlib.import_module(TE)
    backend_classes = {LOCAL.column_parallel_linear, LOCAL.row_parallel_linear, LOCAL.core_attention, LOCAL.norm}
    differing = set()
    for path in set(te_spec) | set(local_spec):
        te_value, local_value = te_spec.get(path), local_spec.get(path)
        if isinstance(te_value, tuple) and te_value[0] == "import path":
            module, name = te_value[1]
            assert module == TE and hasattr(extension, name), te_value
            differing.add(path)
            assert local_value in backend_classes, (path, local_value)
        elif path.endswith("input_layernorm") or path.endswith("pre_mlp_layernorm") or "keys_map" in path:
            differing.add(path)  # TE fuses the norm into the next GEMM: identity + key map
        else:
            assert te_value == local_value, (path, te_value, local_value)
    # What is shared is shared: the frozen projection and the attention classes.
    if role == "share":
        assert te_spec[".submodules.self_attention.submodules.linear_frozen"] is FrozenProjection
    assert te_spec[".submodules.self_attention.module"] is (SharedAttention if role == "share" else ComputingAttention)
    assert differing


def test_local_spec_classes_and_checkpoint_key_map():
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear

    from epas_megatron.model.core_attention import SDPAttention

    share = layer_spec("share", LOCAL, share="kv")
    attn = share.submodules.self_attention
    assert attn.params["share"] == "kv"
    assert attn.submodules.linear_own is ColumnParallelLinear
    assert attn.submodules.core_attention is SDPAttention
    assert share.submodules.input_layernorm is LOCAL.norm
    # Local and TE layers save norms under the same keys.
    assert share.submodules.sharded_state_dict_keys_map["input_layernorm."] == "self_attention.linear_qkv.layer_norm_"


def test_decoder_specs_follow_roles():
    specs = decoder_layer_specs(layer_modes(6, (4, 5)))
    kinds = [s.submodules.self_attention.module.__name__ for s in specs]
    assert kinds == ["ComputingAttention"] * 4 + ["SharedAttention"] * 2
    assert [s.submodules.self_attention.params.get("hand_off") for s in specs[:4]] == [None, None, None, "qk"]
