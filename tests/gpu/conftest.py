"""The GPU suite: skipped, with the reason, where no CUDA device is present.

Run on a GPU node with ``pytest -m gpu tests/gpu`` (or ``tools/gpu_check.sh``, which also sets up
a bare node). Each test says which GPU-only path it proves; the ledger in docs/gpu-ledger.md records where
the suite has run.
"""

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="no CUDA device: the GPU suite runs on a GPU node (pytest -m gpu tests/gpu, or tools/gpu_check.sh)")
    for item in items:
        if "tests/gpu/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(skip)



@pytest.fixture(scope="module")
def world():
    """A one-process world (NCCL on the GPU) with Megatron's TP=1/PP=1 groups, for a module."""
    from epas_megatron.runtime.distributed import destroy_distributed, init_distributed

    dims = init_distributed(1, 1, None, seed=0)
    yield dims
    destroy_distributed()
