import pytest


@pytest.fixture(scope="module")
def single_process():
    from epas_megatron.runtime.distributed import destroy_distributed, init_distributed

    dims = init_distributed(1, 1, None, seed=1234)
    yield dims
    destroy_distributed()
