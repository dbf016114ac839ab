"""Session-wide setup (one data cache for every trainer run in the suite) and the fixtures of
in-process model tests (a world of one process, a tiny GQA architecture)."""

import os

import pytest

pytest_plugins = ["strict_skips"]  # tests/strict_skips.py: EPAS_STRICT_SKIPS=1 turns skips into failures

CPU_ONLY_REASON = (
    "asserts the behaviour of a machine without CUDA (CPU stand-ins, gloo, fp32 defaults); on a GPU node the CPU "
    "suite runs with the GPUs hidden: CUDA_VISIBLE_DEVICES= pytest tests"
)


def pytest_configure(config):
    config.addinivalue_line("markers", f"cpu_only: skipped where torch sees a CUDA device ({CPU_ONLY_REASON})")


def pytest_collection_modifyitems(config, items):
    """``cpu_only`` tests skip where CUDA is usable, so the suite runs on a GPU node too; so do the
    CPU suite's ``distributed`` tests (two gloo ranks per launch; on a GPU node the trainer would
    take NCCL and one GPU per rank)."""
    marked = [item for item in items if item.get_closest_marker("cpu_only")
              or (item.get_closest_marker("distributed") and not item.get_closest_marker("gpu"))]
    if not marked:
        return
    import torch

    if torch.cuda.is_available():
        for item in marked:
            item.add_marker(pytest.mark.skip(reason=CPU_ONLY_REASON))


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
    from epas_megatron.model.architecture import LlamaArchitecture

    # GQA (4 query heads, 2 KV groups), a large init so attention is far from uniform.
    return LlamaArchitecture(num_layers=4, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                             ffn_hidden_size=176, vocab_size=256, max_sequence_length=32, init_method_std=0.2)


TINY_EPAS_ARGS = ["--preset", "tiny", "--no-tensorboard", "--log-interval", "1", "--train-iters", "8",
                  "--global-batch-size", "4", "--micro-batch-size", "2", "--epas-target-layers", "2", "--epas-interval", "3",
                  "--eval-interval", "8", "--eval-iters", "2", "--init-method-std", "0.1"]
"""The session's shared EPAS checkpoint: the tiny preset, 8 iterations, region [3] from 3 and
[2, 3] from 6 (trained region 2), validation at the end."""


@pytest.fixture(scope="session")
def tiny_epas_run(tmp_path_factory):
    """One trained tiny EPAS run (:data:`TINY_EPAS_ARGS`) that evaluation, generation and
    lm-eval tests read (none of them writes into it)."""
    from epas_testing import run_trainer

    run = run_trainer(TINY_EPAS_ARGS, tmp_path_factory.mktemp("tiny-epas") / "run")
    assert [s["sharing_layers"] for s in run.switches] == [[3], [2, 3]]
    return run
