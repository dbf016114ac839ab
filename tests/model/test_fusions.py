"""Fusion flags: every combination of available kernels and layer backend (no GPU needed), the
reasons in the banner, the compiler probe, and the LM head's own gradient-accumulation setting."""

import itertools
import re

import pytest

from epas_megatron.model.fusions import (
    BACKENDS,
    KernelAvailability,
    describe,
    fusion_off_reasons,
    fusion_settings,
    output_layer_gradient_accumulation_fusion,
    triton_compiler_problem,
)

NO_COMPILER = "torch.compile cannot build Triton kernels: no C compiler"

ALL_KERNELS = [
    KernelAvailability(cuda, te_rope, apex_softmax, apex_ga, jit_problem if cuda else None)
    for cuda, te_rope, apex_softmax, apex_ga, jit_problem in itertools.product(
        (False, True), (False, True), (False, True), (False, True), (None, NO_COMPILER))
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kernels", ALL_KERNELS)
def test_each_fusion_is_on_exactly_where_its_kernel_exists(kernels, backend):
    """Safety: a flag is on only where the kernel behind it exists (on this backend's layers);
    liveness: it is on wherever that kernel exists."""
    flags = fusion_settings(kernels, backend)
    can_compile = kernels.cuda and kernels.jit_fuser_problem is None
    kernel_exists = {
        "bias_activation_fusion": can_compile,  # Megatron's jit_fuser: torch.compile -> Triton
        "bias_dropout_fusion": can_compile,
        "masked_softmax_fusion": kernels.cuda and kernels.apex_softmax,
        "apply_rope_fusion": kernels.cuda and kernels.te_rope,
        # TE's linear layers accumulate into main_grad themselves; local layers need apex
        "gradient_accumulation_fusion": kernels.cuda and (backend == "transformer_engine" or kernels.apex_gradient_accumulation),
        "persist_layer_norm": False,  # RMSNorm: apex's persistent LayerNorm never applies
    }
    assert flags == kernel_exists
    # the LM head is a local ColumnParallelLinear on both backends: apex or nothing
    assert output_layer_gradient_accumulation_fusion(kernels, backend) == (kernels.cuda and kernels.apex_gradient_accumulation)
    reasons = fusion_off_reasons(kernels, backend)
    if not kernels.cuda:
        assert reasons == {}
    else:
        assert all(not flags.get(flag, False) for flag in reasons)  # reasons only for flags that are off
        assert ("bias_activation_fusion" in reasons) == (kernels.jit_fuser_problem is not None)


def test_unknown_backend():
    with pytest.raises(ValueError, match="transformer_engine"):
        fusion_settings(ALL_KERNELS[0], "te")


def test_banner_says_what_is_off_and_why():
    kernels = KernelAvailability(cuda=True, te_rope=False, apex_softmax=False, apex_gradient_accumulation=False,
                                 jit_fuser_problem=NO_COMPILER)
    local = describe(fusion_settings(kernels, "local"), fusion_off_reasons(kernels, "local"))
    assert local == ("fused kernels: none; off: bias-activation, bias-dropout (torch.compile cannot build Triton kernels: "
                     "no C compiler); apply-rope (needs Transformer Engine); gradient-accumulation (local layers need "
                     "apex's fused_weight_gradient_mlp_cuda)")
    te = describe(fusion_settings(kernels, "transformer_engine"), fusion_off_reasons(kernels, "transformer_engine"))
    assert te.startswith("fused kernels: gradient-accumulation; off: ") and "output-layer-gradient-accumulation (the LM head" in te
    # without reasons, as before: what is on
    assert describe(fusion_settings(ALL_KERNELS[0])) == "fused kernels: none"


def test_triton_compiler_probe_follows_tritons_rule():
    """$CC as given (must exist), else gcc, else clang -- `cc` alone does not count."""
    def which(found):
        return lambda name: f"/usr/bin/{name}" if name in found else None

    assert triton_compiler_problem({}, which({"gcc"})) is None
    assert triton_compiler_problem({}, which({"clang"})) is None
    assert "neither gcc nor clang" in triton_compiler_problem({}, which({"cc"}))
    assert triton_compiler_problem({"CC": "cc"}, which({"cc"})) is None
    assert "CC='/opt/missing-cc'" in triton_compiler_problem({"CC": "/opt/missing-cc"}, which({"gcc"}))


def test_transformer_config_follows_the_backend(tiny_arch):
    from epas_megatron.model.build_plan import BuildPlan
    from epas_megatron.model.builder import make_transformer_config

    kernels = KernelAvailability(cuda=True, te_rope=False, apex_softmax=False, apex_gradient_accumulation=False,
                                 jit_fuser_problem=NO_COMPILER)
    te = make_transformer_config(BuildPlan.for_region(tiny_arch, backend="transformer_engine"), kernels)
    local = make_transformer_config(BuildPlan.for_region(tiny_arch), kernels)
    assert te.gradient_accumulation_fusion and not local.gradient_accumulation_fusion
    assert not te.bias_activation_fusion and not te.bias_dropout_fusion  # no compiler: unfused paths


def test_lm_head_has_its_own_gradient_accumulation_setting(single_process, tiny_arch):
    """With the fusion on for the decoder (TE layers) and no apex, the local LM head builds
    unfused; with the config's setting, Megatron's ColumnParallelLinear refuses to build."""
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    from epas_megatron.model.build_plan import BuildPlan
    from epas_megatron.model.builder import make_transformer_config
    from epas_megatron.model.gpt import EpasGPTModel
    from epas_megatron.model.specs import LOCAL

    kernels = KernelAvailability(cuda=False, te_rope=False, apex_softmax=False, apex_gradient_accumulation=False)
    config = make_transformer_config(BuildPlan.for_region(tiny_arch), kernels)
    config.gradient_accumulation_fusion = True  # as for TE decoder layers
    no_layers = TransformerBlockSubmodules(layer_specs=[], layer_norm=LOCAL.norm)  # (local layers would need apex)
    model = EpasGPTModel(config, no_layers, tiny_arch.vocab_size, 32, output_layer_gradient_accumulation_fusion=False)
    assert model.output_layer.gradient_accumulation_fusion is False
    assert config.gradient_accumulation_fusion is True and model.config is config  # the rest keeps the shared config
    with pytest.raises(RuntimeError, match="fused_weight_gradient_mlp_cuda"):
        EpasGPTModel(config, no_layers, tiny_arch.vocab_size, 32)


def test_the_jit_fuser_probe_runs_here():
    """The probe behind ``jit_fuser_problem`` (detect() calls it on CUDA machines only): Megatron
    0.19's fused functions are torch.compile'd, and without a GPU Triton has no device."""
    import torch

    from epas_megatron.model.fusions import _jit_fuser_problem

    problem = _jit_fuser_problem()
    if not torch.cuda.is_available():
        assert problem == "torch.compile has no Triton for this GPU"
    assert KernelAvailability.detect().jit_fuser_problem == (problem if torch.cuda.is_available() else None)


def test_activation_kernels_follow_the_device_and_the_jit_fuser():
    from epas_megatron.model.fusions import ASSUMED_GPU, KernelAvailability, activation_kernels, torch_fuses_rms_norm

    cpu = KernelAvailability(cuda=False, te_rope=False, apex_softmax=False, apex_gradient_accumulation=False)
    assert activation_kernels(cpu) == {"fused_norm": False, "fused_swiglu": False}
    assert activation_kernels(ASSUMED_GPU) == {"fused_norm": torch_fuses_rms_norm(), "fused_swiglu": True}
    no_compiler = KernelAvailability(cuda=True, te_rope=False, apex_softmax=False, apex_gradient_accumulation=False,
                                     jit_fuser_problem="no C compiler")
    assert activation_kernels(no_compiler)["fused_swiglu"] is False
    assert [torch_fuses_rms_norm(v) for v in ("2.6.0", "2.7.1+cu126", "2.8.0", "2.11.0+cu130", "2.14.1")] == [
        False, False, True, True, True]


def test_the_triton_launch_probe_runs_a_real_kernel(monkeypatch):
    """The probe's kernel compiles and computes 1..8 from 0..7 in Triton's interpreter (the CPU
    equivalent of a launch); without the interpreter a CPU has no Triton driver, and the probe
    says so in one line instead of raising."""
    from epas_megatron.model.fusions import triton_launch_problem

    triton_launch_problem.cache_clear()
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    try:
        assert triton_launch_problem("cpu") is None
        triton_launch_problem.cache_clear()
        monkeypatch.delenv("TRITON_INTERPRET")
        import torch

        if not torch.cuda.is_available():
            problem = triton_launch_problem("cpu")
            assert problem.startswith("a trivial Triton kernel did not build and run (") and "\n" not in problem
    finally:
        triton_launch_problem.cache_clear()


def test_the_jit_fuser_probe_builds_and_launches_before_turning_fusions_on(monkeypatch):
    """On a GPU node (faked: Triton present), the compiled fusions are on only when a trivial
    kernel builds and runs; a node with a compiler but without Python headers, or whose launch
    fails, keeps them off with that reason (the first forward would otherwise fail inside
    Inductor)."""
    import torch.utils._triton

    from epas_megatron.model import fusions

    monkeypatch.setattr(torch.utils._triton, "has_triton", lambda: True)
    monkeypatch.setattr(fusions, "triton_compiler_problem", lambda: None)
    monkeypatch.setattr(fusions, "python_headers_problem", lambda: None)
    launched = []
    assert fusions._jit_fuser_problem(launch=lambda: launched.append(1)) is None and launched == [1]
    failed = fusions._jit_fuser_problem(launch=lambda: "a trivial Triton kernel did not build and run (CalledProcessError: gcc)")
    assert failed == "torch.compile cannot build Triton kernels: a trivial Triton kernel did not build and run (CalledProcessError: gcc)"
    monkeypatch.setattr(fusions, "python_headers_problem", lambda: "no Python headers for Triton's launcher (x)")
    launched.clear()
    assert "no Python headers" in fusions._jit_fuser_problem(launch=lambda: launched.append(1)) and not launched
    kernels = KernelAvailability(cuda=True, te_rope=False, apex_softmax=False, apex_gradient_accumulation=False,
                                 jit_fuser_problem=failed)
    assert "did not build and run" in describe(fusion_settings(kernels), fusion_off_reasons(kernels))


def test_python_headers_probe(tmp_path):
    from epas_megatron.model.fusions import python_headers_problem

    assert python_headers_problem() is None  # this machine's Python has its headers (Triton's launcher builds here)
    assert f"{tmp_path}/Python.h is missing" in python_headers_problem(str(tmp_path))
    (tmp_path / "Python.h").write_text("")
    assert python_headers_problem(str(tmp_path)) is None


def _probe(installed, error=None):
    from epas_megatron.model.fusions import TransformerEngineProbe

    return lambda: TransformerEngineProbe(installed, error)


@pytest.mark.parametrize("impl, cuda, te, expected", [
    ("local", True, _probe(True), ("local", "--transformer-impl local")),
    ("auto", False, _probe(True, "never asked"), ("local", "auto: no GPU")),
    ("auto", True, _probe(False), ("local", "auto: Transformer Engine is not installed")),
    ("auto", True, _probe(True), ("transformer_engine", "auto: Transformer Engine loads on this GPU node")),
    ("transformer_engine", True, _probe(True), ("transformer_engine", "--transformer-impl transformer_engine")),
    ("auto", True, _probe(True, "OSError: libcudnn.so.9: cannot open shared object file"),
     "--transformer-impl auto: Transformer Engine is installed but does not load (OSError: libcudnn.so.9"),
    ("transformer_engine", True, _probe(True, "ImportError: x"), "or pass --transformer-impl local for local layers"),
    ("transformer_engine", True, _probe(False), "Transformer Engine is not installed (pip install -r requirements-gpu.txt)"),
    ("transformer_engine", False, _probe(True), "needs a GPU; use --transformer-impl local on CPU"),
])
def test_layer_backend_choice_never_falls_back_in_silence(impl, cuda, te, expected):
    """Every --transformer-impl on every kind of node: the backend and the reason printed at
    start-up, or an error naming the backend and --transformer-impl local -- an installed TE
    that does not load is never quietly replaced by local layers."""
    from epas_megatron.errors import ConfigError
    from epas_megatron.model.fusions import choose_backend, choose_layers

    if isinstance(expected, tuple):
        choice = choose_layers(impl, cuda, te)
        assert (choice.backend, choice.reason) == expected
        assert choose_backend(impl, cuda, te) == expected[0]  # loading a checkpoint picks the same layers
    else:
        with pytest.raises(ConfigError, match=re.escape(expected)):
            choose_layers(impl, cuda, te)
    if te().installed and te().error is not None and cuda:
        with pytest.raises(ConfigError, match="installed but does not load"):
            choose_backend(impl, cuda, te)


def test_the_start_up_line_says_why_auto_chose_its_layers(tmp_path, monkeypatch):
    from epas_megatron.config.cli import parse_config
    from epas_megatron.training.reporting import layers_description
    from epas_megatron.validation import resolve_run

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    run = resolve_run(parse_config(["--preset", "tiny", "--output-dir", str(tmp_path)]), world_size=1, cuda=False)
    assert (run.backend, run.backend_reason) == ("local", "auto: no GPU")
    assert layers_description(run).startswith("local layers (auto: no GPU), sdpa attention, fused kernels")
    run = resolve_run(parse_config(["--preset", "tiny", "--transformer-impl", "local", "--output-dir", str(tmp_path)]),
                      world_size=1, cuda=False)
    assert layers_description(run).startswith("local layers, sdpa attention")
