"""Session-wide setup (one data cache for every trainer run in the suite) and the fixtures of
in-process model tests (a world of one process, a tiny GQA architecture)."""

import os

import pytest


@pytest.fixture(scope="session", autouse=True)
def epas_cache_dir(tmp_path_factory):
    """EPAS_CACHE_DIR for in-process and subprocess runs: the embedded corpus, its tokenizer and
    dataset indices are built once per session."""
    path = os.environ.get("EPAS_TEST_CACHE_DIR") or str(tmp_path_factory.mktemp("epas-cache"))
    os.environ["EPAS_CACHE_DIR"] = path
    return path


@pytest.fixture(scope="module")
def single_process():
    """A world of one process (gloo) with Megatron's TP=1/PP=1 groups."""
    from epas_megatron.runtime.distributed import destroy_distributed, init_distributed

    dims = init_distributed(1, 1, None, seed=1234)
    yield dims
    destroy_distributed()


@pytest.fixture(scope="module")
def tiny_arch():
    from epas_megatron.model.builder import LlamaArchitecture

    # GQA (4 query heads, 2 KV groups), a large init so attention is far from uniform.
    return LlamaArchitecture(num_layers=4, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                             ffn_hidden_size=176, vocab_size=256, max_sequence_length=32, init_method_std=0.2)
