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


SLURM_FILES = "tests/launch/test_slurm_"
"""Every ``slurm`` test lives in a file whose path starts with this: with ``-n N`` they form one
unit of work (one session cluster, on one worker)."""


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    _slurm_tests_first(items)
    _skip_cpu_only_where_cuda_works(items)


def _slurm_tests_first(items):
    """The ``slurm`` tests go first: with ``-n 2`` (pytest-xdist) they are the longest unit of work
    (about two and a half minutes, mostly waiting on Slurm), and the other worker fills that time
    with the rest of the suite. The order of every other test stays as collected."""
    items.sort(key=lambda item: not item.nodeid.startswith(SLURM_FILES))


def pytest_collection_finish(session):
    """What collection imported (torch, Megatron-Core, transformers: about 500,000 objects) lives as
    long as the session: frozen (epas_megatron/runtime/garbage.py), it is skipped by every
    collection after, the trainer's before each model build among them (0.25 s each otherwise)."""
    from epas_megatron.runtime.garbage import freeze_long_lived

    freeze_long_lived()


def pytest_runtest_setup(item):
    """A ``slurm`` test outside :data:`SLURM_FILES` fails: under ``-n 2`` it would bring up a
    second cluster on the other worker, whose jobs take the same rendezvous ports."""
    if item.get_closest_marker("slurm") and not item.nodeid.startswith(SLURM_FILES):
        pytest.fail(f"slurm tests must live in {SLURM_FILES}*.py (one unit of work under -n, one cluster); "
                    f"move {item.nodeid} there", pytrace=False)


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_xdist_make_scheduler(config, log):
    """With ``-n N`` a worker takes whole files, never single tests: module fixtures (a trained run,
    a two-rank world of variants) are built once, as without xdist, and session fixtures at most
    once per worker. The Slurm files are one unit (one cluster per session)."""
    from xdist.scheduler import LoadScopeScheduling

    class FileScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid):
            path = nodeid.split("::", 1)[0]
            return SLURM_FILES if path.startswith(SLURM_FILES) else path

    config.option.loadscopereorder = False  # the collection's order: Slurm first (see _slurm_tests_first)
    return FileScheduling(config, log)


def _skip_cpu_only_where_cuda_works(items):
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
