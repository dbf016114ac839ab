"""Layer specs: roles, and each layer's spec tree against Megatron-Core's own GPT layer specs
(the Transformer Engine ones built without TE)."""

import dataclasses
import importlib
import sys
from functools import partial

import pytest
import torch

from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.spec_utils import ModuleSpec

from epas_megatron.errors import ConfigError
from epas_megatron.model.attention import FrozenProjection, SharedAttention
from epas_megatron.model.specs import LOCAL, TRANSFORMER_ENGINE, decoder_layer_specs, get_backend, layer_spec
from epas_megatron.sharing.shape import RegionShape, layer_modes


def test_roles():
    assert layer_modes(4, ()) == ["compute"] * 4
    assert layer_modes(4, (2, 3)) == ["compute", "source", "share", "share"]
    with pytest.raises(ConfigError, match="last layer"):
        layer_modes(4, (1, 2))
    with pytest.raises(ConfigError, match="no source"):
        layer_modes(4, (0, 1, 2, 3))


def _tree(spec, path=""):
    """{path: leaf} of a layer spec tree (ModuleSpecs, submodule dataclasses, partials). A class
    named by import path (our TE spec) becomes the object that path names, so it compares equal to
    the class (or, without Transformer Engine, the placeholder) Megatron-Core's own specs hold."""
    leaves = {}
    if isinstance(spec, ModuleSpec) and isinstance(spec.module, tuple):
        module, name = spec.module
        leaves[path] = getattr(importlib.import_module(module), name)
    elif isinstance(spec, ModuleSpec):
        leaves[path + ".module"] = spec.module
        leaves[path + ".params"] = spec.params
        if spec.submodules is not None:
            leaves.update(_tree(spec.submodules, path + ".submodules"))
    elif isinstance(spec, partial):
        leaves[path + ".func"] = spec.func
        for key, value in spec.keywords.items():
            leaves.update(_tree(value, f"{path}.{key}"))
    elif dataclasses.is_dataclass(spec) and not isinstance(spec, type):
        for field in dataclasses.fields(spec):
            leaves.update(_tree(getattr(spec, field.name), f"{path}.{field.name}"))
    else:
        leaves[path] = spec
    return leaves


ATTENTION = ".submodules.self_attention"
KEYS_MAP = ".submodules.sharded_state_dict_keys_map"


def _named(value):
    """For failure messages: TE classes by name (without TE they are anonymous placeholders)."""
    extension = sys.modules.get("megatron.core.extensions.transformer_engine")
    names = [n for n in dir(extension) if n.startswith("TE") and getattr(extension, n) is value]
    return f"TE:{names[0]}" if len(names) == 1 else value


def _assert_same_except(ours, reference, skip):
    """Every slot of two spec trees equal, except paths starting with one of ``skip``."""
    absent = "<absent>"
    paths = {p for p in set(ours) | set(reference) if not p.startswith(tuple(skip))}
    different = {p: (_named(ours.get(p, absent)), _named(reference.get(p, absent))) for p in sorted(paths)
                 if ours.get(p, absent) != reference.get(p, absent)}
    assert not different, different


def _assert_megatron_roles(ours, reference):
    """Our layer and attention classes are Megatron's, subclassed, with Megatron's parameters."""
    assert issubclass(ours[".module"], reference[".module"])
    assert issubclass(ours[ATTENTION + ".module"], reference[ATTENTION + ".module"])
    assert reference[ATTENTION + ".params"].items() <= ours[ATTENTION + ".params"].items()


@pytest.fixture
def megatron_te_layer_spec(monkeypatch):
    """Megatron-Core's own TE layer spec (``get_gpt_layer_with_transformer_engine_spec``). Without
    Transformer Engine, ``gpt_layer_specs`` sets its TE spec provider to None; the provider module
    itself imports (Megatron's TE extension then holds placeholders for TE's classes), so it is put
    back for the call. With TE installed nothing is patched."""
    from megatron.core.models.gpt import gpt_layer_specs

    if gpt_layer_specs.TESpecProvider is None:
        from megatron.core.extensions.transformer_engine_spec_provider import TESpecProvider

        monkeypatch.setattr(gpt_layer_specs, "TESpecProvider", TESpecProvider)
    return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec()


@pytest.mark.parametrize("role", ["compute", "source"])
def test_te_computing_layer_is_megatron_cores_te_layer(role, megatron_te_layer_spec):
    """Same TE class in every slot as Megatron-Core's own TE GPT layer (norms fused into
    linear_qkv and linear_fc1, identity norms around them). Megatron's key map only renames
    the modules of TE's op fuser, which is not used here; ours is checked in
    test_sharing_layer_differs_from_the_computing_layer_only_in_qk."""
    ours = _tree(layer_spec(role, TRANSFORMER_ENGINE))
    reference = _tree(megatron_te_layer_spec)
    _assert_megatron_roles(ours, reference)
    _assert_same_except(ours, reference, skip=[".module", ATTENTION + ".module", ATTENTION + ".params", KEYS_MAP])


def test_local_computing_layer_is_megatron_cores_local_layer():
    """Megatron-Core's own local GPT layer (RMSNorm) with unfused attention, slot by slot,
    checkpoint key map included; only the norm class is ours (Megatron's local norm refuses
    sequence parallelism, see model/norm.py), and the linears are Megatron's subclassed for the
    weight-gradient split (model/weight_grad.py). The default local attention kernel, SDPA, takes
    the place of ``DotProductAttention``."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from epas_megatron.model.core_attention import SDPAttention
    from epas_megatron.model.weight_grad import DelayedWgradColumnParallelLinear, DelayedWgradRowParallelLinear

    reference = _tree(get_gpt_layer_local_spec(normalization="RMSNorm"))
    ours = _tree(layer_spec("compute", get_backend("local", "unfused")))
    _assert_megatron_roles(ours, reference)
    norms = [".submodules.input_layernorm", ".submodules.pre_mlp_layernorm"]
    linears = {ATTENTION + ".submodules.linear_qkv": ColumnParallelLinear, ATTENTION + ".submodules.linear_proj": RowParallelLinear,
               ".submodules.mlp.submodules.linear_fc1": ColumnParallelLinear, ".submodules.mlp.submodules.linear_fc2": RowParallelLinear}
    for path, base in linears.items():
        assert reference[path] is base and ours[path].__bases__[-1] is base
        assert ours[path] in (DelayedWgradColumnParallelLinear, DelayedWgradRowParallelLinear)
    _assert_same_except(ours, reference, skip=[".module", ATTENTION + ".module", ATTENTION + ".params", *norms, *linears])
    assert ours[norms[0]] is ours[norms[1]] is not IdentityOp

    sdpa = _tree(layer_spec("compute", LOCAL))
    core = ATTENTION + ".submodules.core_attention"
    assert (reference[core], sdpa[core]) == (DotProductAttention, SDPAttention)
    _assert_same_except(sdpa, ours, skip=[core])


@pytest.mark.parametrize("backend", [LOCAL, TRANSFORMER_ENGINE], ids=lambda b: b.name)
@pytest.mark.parametrize("share, own", [("qk", "v"), ("kv", "q")])
def test_sharing_layer_differs_from_the_computing_layer_only_in_qk(backend, share, own):
    """A sharing layer is the computing layer with its attention's QKV GEMM replaced by a GEMM of
    the same class for its own part alone (V for EPAS, Q for the KV variant; the width is checked
    in test_sharing_layer.py) and a frozen weight holder that never runs; everything else, core
    attention and output projection included, is the computing layer's. Its fused norm (TE) is
    saved under the computing layer's key, so one checkpoint loads into either."""
    computing = _tree(layer_spec("compute", backend, share=share))
    sharing = _tree(layer_spec("share", backend, share=share))
    _assert_same_except(sharing, computing, skip=[ATTENTION, KEYS_MAP])

    attention = ATTENTION + ".submodules."
    assert sharing[ATTENTION + ".module"] is SharedAttention
    assert sharing[ATTENTION + ".params"]["share"] == share
    assert sharing[ATTENTION + ".params"]["attn_mask_type"] == computing[ATTENTION + ".params"]["attn_mask_type"]
    slots = {p[len(attention):] for p in sharing if p.startswith(attention)}
    assert slots == {"linear_own", "linear_frozen", "core_attention", "linear_proj"}  # no linear_qkv
    assert sharing[attention + "linear_own"] == computing[attention + "linear_qkv"]
    for slot in ("core_attention", "linear_proj"):
        assert sharing[attention + slot] == computing[attention + slot]
    frozen = sharing[attention + "linear_frozen"]
    assert frozen is FrozenProjection and issubclass(frozen, torch.nn.Module)
    with pytest.raises(RuntimeError, match="never run"):
        frozen.forward(None)

    norm_key = "self_attention.linear_qkv.layer_norm_"
    if backend is LOCAL:  # unfused norms: the same map as the computing layer (Megatron's)
        assert sharing[KEYS_MAP] == computing[KEYS_MAP]
        assert computing[KEYS_MAP]["input_layernorm."] == norm_key
    else:
        assert sharing[KEYS_MAP] == {**computing[KEYS_MAP], f"self_attention.linear_{own}.layer_norm_": norm_key}


def test_building_a_te_spec_imports_no_transformer_engine():
    before = "transformer_engine" in sys.modules
    layer_spec("compute", TRANSFORMER_ENGINE)
    layer_spec("share", TRANSFORMER_ENGINE)
    assert ("transformer_engine" in sys.modules) == before


def test_decoder_specs_follow_roles():
    specs = decoder_layer_specs(layer_modes(6, (4, 5)))
    kinds = [s.submodules.self_attention.module.__name__ for s in specs]
    assert kinds == ["ComputingAttention"] * 4 + ["SharedAttention"] * 2
    assert [s.submodules.self_attention.params.get("hand_off") for s in specs[:4]] == [None, None, None, "qk"]


def test_build_plan_keeps_exclude_last_and_places_the_hand_off():
    """--epas-exclude-last on the build plan: its regions end at num_layers - 1 - N through a
    switch (with_region) and region_layers; the computing tail never receives a hand-off."""
    from epas_megatron.model.architecture import LlamaArchitecture
    from epas_megatron.model.build_plan import BuildPlan
    from epas_megatron.model.builder import chunk_placements, make_transformer_config, pipeline_handoff_rows
    from epas_megatron.parallel.layout import StageLayout

    arch = LlamaArchitecture(8, 64, 4, 2, 176, 256, 32)
    plan = BuildPlan.for_region(arch, (5,), seq_length=32, pp=2, shape=RegionShape(8, exclude_last=2))
    assert plan.shape.exclude_last == 2 and plan.sharing_layers == (5,)
    assert plan.modes[4:] == ("source", "share", "compute", "compute")
    assert plan.region_layers(3) == (3, 4, 5) and plan.region_layers(0) == ()
    with pytest.raises(ConfigError, match="--regions 6"):
        plan.region_layers(6)
    grown = plan.with_region(plan.region_layers(3))
    assert grown.shape == RegionShape(8, exclude_last=2) and grown.sharing_layers == (3, 4, 5)
    with pytest.raises(ConfigError, match="--epas-exclude-last 2"):
        plan.with_region((6, 7))
    with pytest.raises(ConfigError, match="--epas-exclude-last"):
        BuildPlan.for_region(arch, (3, 4, 5))  # exclude_last 0: must end at the last layer
    with pytest.raises(ConfigError):
        dataclasses.replace(grown, shape=RegionShape(8))  # modes that are not the plan's region
    with pytest.raises(ValueError, match="a region shape of 6 layers"):
        dataclasses.replace(grown, shape=RegionShape(6))

    def placements(plan):
        config = make_transformer_config(plan)
        rows = pipeline_handoff_rows(config, plan.modes, 32, "qk")[1]
        return [(p.layer_ids, p.receives_handoff, p.sends_handoff) for r in range(2) for p in chunk_placements(config, plan.modes, r)], rows

    # Even split (0-3 | 4-7): the region 3-5 crosses the boundary; the tail 6-7 is on stage 1.
    assert placements(grown) == ([((0, 1, 2, 3), False, True), ((4, 5, 6, 7), True, False)], 32 + 48)
    # A region within one stage, and a boundary right after the region: nothing to send.
    assert placements(plan)[1] == 32
    after = grown.with_region((3, 4, 5), StageLayout.from_layout_string("Etttttt|ttL", 2))
    assert placements(after) == ([((0, 1, 2, 3, 4, 5), False, False), ((6, 7), False, False)], 32)
