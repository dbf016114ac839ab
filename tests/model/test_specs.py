"""Layer specs: roles, and each layer's spec tree against Megatron-Core's own GPT layer specs
(the Transformer Engine ones built without TE); our backends are Megatron-Core's spec providers."""

import dataclasses
import inspect
import subprocess
import sys
from functools import partial

import pytest
import torch

from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.spec_utils import ModuleSpec

from epas_megatron.errors import ConfigError
from epas_megatron.model.attention import FrozenProjection, SharedAttention
from epas_megatron.model.specs import LOCAL, EpasLocalSpecProvider, decoder_layer_specs, get_backend, layer_spec
from epas_megatron.sharing.shape import RegionShape, layer_modes


def test_roles():
    assert layer_modes(4, ()) == ["compute"] * 4
    assert layer_modes(4, (2, 3)) == ["compute", "source", "share", "share"]
    with pytest.raises(ConfigError, match="last layer"):
        layer_modes(4, (1, 2))
    with pytest.raises(ConfigError, match="no source"):
        layer_modes(4, (0, 1, 2, 3))


def _tree(spec, path=""):
    """{path: leaf} of a layer spec tree (ModuleSpecs, submodule dataclasses, partials)."""
    leaves = {}
    if isinstance(spec, ModuleSpec):
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
    ours = _tree(layer_spec(role, get_backend("transformer_engine")))
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

    sdpa = _tree(layer_spec("compute", get_backend("local")))
    core = ATTENTION + ".submodules.core_attention"
    assert (reference[core], sdpa[core]) == (DotProductAttention, SDPAttention)
    _assert_same_except(sdpa, ours, skip=[core])


@pytest.mark.parametrize("name", ["local", "transformer_engine"])
@pytest.mark.parametrize("share, own", [("qk", "v"), ("kv", "q")])
def test_sharing_layer_differs_from_the_computing_layer_only_in_qk(name, share, own):
    """A sharing layer is the computing layer with its attention's QKV GEMM replaced by a GEMM of
    the same class for its own part alone (V for EPAS, Q for the KV variant; the width is checked
    in test_sharing_layer.py) and a frozen weight holder that never runs; everything else, core
    attention and output projection included, is the computing layer's. Its fused norm (TE) is
    saved under the computing layer's key, so one checkpoint loads into either."""
    backend = get_backend(name)
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
    if name == "local":  # unfused norms: the same map as the computing layer (Megatron's)
        assert sharing[KEYS_MAP] == computing[KEYS_MAP]
        assert computing[KEYS_MAP]["input_layernorm."] == norm_key
    else:
        assert sharing[KEYS_MAP] == {**computing[KEYS_MAP], f"self_attention.linear_{own}.layer_norm_": norm_key}


_SPEC_IMPORTS = """
import sys
from megatron.core.extensions.transformer_engine import HAVE_TE
from epas_megatron.model.builder import build_model
from epas_megatron.model.specs import decoder_layer_specs, get_backend

PROVIDER = "megatron.core.extensions.transformer_engine_spec_provider"
imported = lambda: (PROVIDER in sys.modules, "transformer_engine" in sys.modules)
before = imported()
assert HAVE_TE or before == (False, False), before
decoder_layer_specs(["compute", "source", "share"], get_backend("local"))
assert imported() == before, imported()
decoder_layer_specs(["compute", "source", "share"], get_backend("transformer_engine"))
assert imported() == (True, before[1]), imported()
print("ok")
"""


def test_building_a_te_spec_imports_no_transformer_engine():
    """In a fresh interpreter: the model code (the builder) imports neither Megatron's TE spec
    provider nor, without TE installed, ``transformer_engine``; choosing the local backend and
    building its specs imports neither; choosing the TE backend imports the provider, and building
    its specs still no ``transformer_engine`` (its classes are placeholders without TE)."""
    proc = subprocess.run([sys.executable, "-W", "ignore", "-c", _SPEC_IMPORTS], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0 and proc.stdout.split() == ["ok"], proc.stderr[-3000:]


def _public_methods(cls) -> list[str]:
    return [n for n, v in inspect.getmembers(cls, inspect.isfunction) if not n.startswith("_")]


def test_local_provider_is_megatrons_with_our_modules_only_where_they_must_differ():
    """Our local provider is Megatron-Core's ``LocalSpecProvider``: it overrides the linears
    (weight-gradient split), the RMSNorm (sequence parallelism) and the core attention
    (--core-attention), and every other method is Megatron's own (so an upstream change reaches
    our layers), answering as Megatron's. The TE provider overrides none of ``TESpecProvider``."""
    from megatron.core.extensions.transformer_engine_spec_provider import TESpecProvider
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from epas_megatron.model.core_attention import SDPAttention
    from epas_megatron.model.norm import RMSNorm
    from epas_megatron.model.weight_grad import DelayedWgradColumnParallelLinear, DelayedWgradRowParallelLinear

    ours, megatron = get_backend("local", "unfused"), LocalSpecProvider()
    assert isinstance(ours, LocalSpecProvider) and isinstance(LOCAL, EpasLocalSpecProvider)
    overridden = {"column_parallel_linear", "row_parallel_linear", "layer_norm", "core_attention"}
    ours_differ = {n for n in _public_methods(LocalSpecProvider) if getattr(EpasLocalSpecProvider, n) is not getattr(LocalSpecProvider, n)}
    assert ours_differ == overridden
    assert (ours.column_parallel_linear(), ours.row_parallel_linear()) == (DelayedWgradColumnParallelLinear, DelayedWgradRowParallelLinear)
    assert ours.layer_norm(rms_norm=True) is ours.norm is RMSNorm
    assert (ours.core_attention(), LOCAL.core_attention()) == (DotProductAttention, SDPAttention)
    assert ours.fuse_layernorm_and_linear() is megatron.fuse_layernorm_and_linear() is False
    assert ours.column_parallel_layer_norm_linear() is megatron.column_parallel_layer_norm_linear() is None
    assert ours.activation_func() is megatron.activation_func()
    for kwargs in ({}, {"for_qk": True}, {"has_residual": True}):  # LayerNorm: Megatron's
        assert ours.layer_norm(**kwargs) is megatron.layer_norm(**kwargs)
    for grouped_gemm in (False, True):
        assert _tree(ours.grouped_mlp_modules(grouped_gemm)) == _tree(megatron.grouped_mlp_modules(grouped_gemm))

    te = get_backend("transformer_engine")
    assert isinstance(te, TESpecProvider) and not isinstance(te, LocalSpecProvider)
    assert all(getattr(type(te), n) is getattr(TESpecProvider, n) for n in _public_methods(TESpecProvider))
    assert te.norm is TESpecProvider().layer_norm(rms_norm=True)


def test_mixture_of_channels_is_local_only():
    from epas_megatron.model.moc import MoCMLP
    from epas_megatron.model.moc_sizes import MoCSettings

    moc = MoCSettings(0.25, 4)  # a build option: it changes the layer spec's mlp slot, and only that
    plain = layer_spec("compute", get_backend("local"))
    ours = moc.layer_spec(plain, "compute", "local")
    assert ours.submodules.mlp.func.__self__ is MoCMLP and ours.submodules.mlp.keywords["topk"] == 0.25
    assert ours.submodules.mlp.keywords["submodules"] is plain.submodules.mlp.keywords["submodules"]
    outside_mlp = [{path: v for path, v in _tree(spec).items() if not path.startswith(".submodules.mlp")} for spec in (ours, plain)]
    assert outside_mlp[0] == outside_mlp[1]
    with pytest.raises(ValueError, match="local layers only"):
        moc.layer_spec(layer_spec("compute", get_backend("transformer_engine")), "compute", "transformer_engine")


def test_unknown_backend_and_core_attention():
    with pytest.raises(ValueError, match="unknown backend 'inference_optimized'"):
        get_backend("inference_optimized")
    with pytest.raises(ValueError, match="unknown core attention 'flash'"):
        get_backend("local", "flash")


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
    from epas_megatron.model.stage_layout import StageLayout

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
