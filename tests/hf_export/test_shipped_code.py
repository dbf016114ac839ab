"""The files an EPAS export ships (``auto_map``) import nothing but torch, transformers (and its
``huggingface_hub``) and each other, so the directory loads where this project is not installed;
the package registers its classes with the Auto classes for users who have it."""

import ast

import pytest

from epas_megatron.hf import SHIPPED_FILES, SOURCE_DIR

ALLOWED = {"torch", "transformers", "huggingface_hub", "__future__", "collections"}


def test_shipped_files_import_only_torch_and_transformers():
    for name in SHIPPED_FILES:
        for node in ast.walk(ast.parse((SOURCE_DIR / name).read_text())):
            if isinstance(node, ast.Import):
                roots = {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                if node.level:  # a sibling: must be shipped too
                    assert f"{node.module}.py" in SHIPPED_FILES, (name, node.module)
                    continue
                roots = {node.module.split(".")[0]}
            else:
                continue
            assert roots <= ALLOWED, (name, roots)


def test_the_package_registers_the_auto_classes():
    from transformers import AutoConfig, AutoModelForCausalLM

    from epas_megatron.hf import EpasLlamaConfig, EpasLlamaForCausalLM

    config = AutoConfig.for_model("epas_llama", num_hidden_layers=3, hidden_size=32, intermediate_size=64,
                                  num_attention_heads=4, epas_sharing_layers=[2])
    assert isinstance(config, EpasLlamaConfig) and config.epas_active_layers == (2,)
    assert type(AutoModelForCausalLM.from_config(config)) is EpasLlamaForCausalLM


def test_a_region_grows_in_the_exported_order():
    """Several blocks (--epas-blocks 2, 8 layers): regions are prefixes of epas_region_order, not the
    deepest layers; without an order, one block's (the deepest first, as exports before it had)."""
    from epas_megatron.hf import EpasLlamaConfig

    shape = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=8, num_attention_heads=4,
                 num_key_value_heads=2)
    config = EpasLlamaConfig(**shape, epas_sharing_layers=[2, 3, 6, 7], epas_region_order=[7, 3, 6, 2], epas_region=2)
    assert config.epas_active_layers == (3, 7)
    assert EpasLlamaConfig(**shape, epas_sharing_layers=[2, 3, 6, 7], epas_region=2).epas_active_layers == (6, 7)
    with pytest.raises(Exception, match="must list epas_sharing_layers"):  # transformers' strict-validation error
        EpasLlamaConfig(**shape, epas_sharing_layers=[2, 3, 6, 7], epas_region_order=[7, 3, 6])


def test_import_finds_the_blocks_of_an_order(tmp_path):
    from epas_megatron.convert.cli import _shape_of
    from epas_megatron.errors import ConfigError

    assert _shape_of([7, 3, 6, 2], 8, 0, tmp_path).blocks == 2 and _shape_of([7, 6, 5, 4], 8, 0, tmp_path).blocks == 1
    assert _shape_of([6, 2, 5], 8, 1, tmp_path).blocks == 2  # --epas-exclude-last 1: spans 0-2 and 3-6
    with pytest.raises(ConfigError, match="epas_region_order \\[3, 7\\] is the order of no sharing region"):
        _shape_of([3, 7], 8, 0, tmp_path)
