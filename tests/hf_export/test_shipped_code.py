"""The files an EPAS export ships (``auto_map``) import nothing but torch, transformers (and its
``huggingface_hub``) and each other, so the directory loads where this project is not installed;
the package registers its classes with the Auto classes for users who have it."""

import ast

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
