"""epas-bench's refusals: exit status 2 and one ``error:`` line naming the flag, before any
process group or model exists. Run through ``main`` in this process (the command line itself is
covered by tests/test_entry_points.py)."""

import pytest
import torch.distributed as dist

from epas_megatron.bench.cli import main

CASES = [
    # train
    (["train", "--preset", "tiny", "--region", "4"], None, "error: --region must be between 1 and 3 for the tiny preset"),
    (["train", "--preset", "tiny", "--method", "epas,ltd"], None, "error: --method 'epas,ltd'"),
    (["train", "--preset", "tiny", "--method", "all", "--kept-tokens", "0"], None, "error: --kept-tokens"),
    (["train", "--preset", "tiny", "--iters", "2", "--blocks", "4"], None, "error: --iters must be at least --blocks"),
    (["train", "--preset", "tiny", "--iters", "0"], None, "error: --iters must be >= 1, got 0"),
    (["train", "--preset", "tiny", "--warmup", "-1"], None, "error: --warmup must be >= 0, got -1"),
    (["train", "--preset", "nope"], None, "error: --preset 'nope' is not a known preset"),
    # pipeline
    (["pipeline", "--preset", "tiny"], None, "error: --tp 1 x --pp 2 does not divide the 1 processes"),
    (["pipeline", "--preset", "tiny", "--pp", "1"], None, "error: --pp must be >= 2 for the pipeline bench"),
    (["pipeline", "--preset", "tiny", "--pp", "2", "--vpp", "3"], 2, "error: --pp x --vpp = 6 stages does not divide the 4 layers"),
    (["pipeline", "--preset", "tiny", "--pp", "2", "--vpp", "1"], 2, "error: --vpp must be >= 2 when given"),
    (["pipeline", "--preset", "tiny", "--pp", "3"], 3, "error: --pp = 3 stages does not divide the 4 layers of the tiny preset"),
    (["pipeline", "--preset", "tiny", "--region", "0"], 2, "error: --region must be between 1 and 3"),
    (["pipeline", "--preset", "tiny", "--num-microbatches", "0"], 2, "error: --num-microbatches must be >= 1, got 0"),
    # pipeline --schedule
    (["pipeline", "--schedule", "1f1b", "v-zb"], 2, "error: --schedule 'v-zb' is not a schedule; choose from 1f1b, v-1f1b"),
    (["pipeline", "--schedule", "interleaved"], 2, "error: --schedule interleaved is Megatron-Core's own schedule"),
    (["pipeline", "--preset", "tiny", "--schedule", "1f1b", "v-half"], None, "error: --schedule runs one pipeline rank per process"),
    (["pipeline", "--preset", "tiny", "--schedule", "1f1b", "v-min"], 4,
     "error: --schedule v-min places 2p = 8 V stages over p = 4 ranks: the tiny preset has 4 layers"),
    (["pipeline", "--preset", "tiny", "--schedule", "1f1b"], 3, "error: --schedule 1f1b splits the 4 layers of the tiny preset evenly"),
    (["pipeline", "--preset", "tiny", "--schedule", "v-half", "--num-microbatches", "1"], 2,
     "error: --num-microbatches 1 is fewer than the p = 2 pipeline ranks"),
    (["pipeline", "--preset", "tiny", "--schedule", "v-half", "--warmup", "0"], 2, "error: --warmup must be >= 1 with --schedule"),
    (["pipeline", "--preset", "tiny", "--schedule", "v-half", "--iters", "0"], 2, "error: --iters must be >= 1, got 0"),
    (["pipeline", "--preset", "tiny", "--schedule", "v-half", "--region", "4"], 2,
     "error: --region must be between 0 (no sharing) and 3"),
    (["pipeline", "--preset", "tiny", "--schedule", "v-half", "--vpp", "2"], 2, "error: --vpp 2: --schedule places the model chunks"),
    (["pipeline", "--preset", "tiny", "--schedule", "v-half", "--pp", "4"], 2, "error: --pp 4: with --schedule the pipeline has one rank"),
    (["pipeline", "--preset", "nope", "--schedule", "v-half"], 2, "error: --preset 'nope' is not a known preset"),
    # decode
    (["decode", "--preset", "tiny", "--region", "4"], None, "error: --region must be between 1 and 3 for the tiny preset"),
    (["decode", "--preset", "tiny", "--region", "2"], 2, "error: epas-bench decode runs in one process"),
    # switch
    (["switch", "--steps", "1"], None, "error: --steps must be >= 2"),
    (["switch", "--repeats", "0"], None, "error: --repeats must be >= 1"),
    (["switch", "--preset", "nope"], None, "error: --preset 'nope' is not a known preset"),
]


@pytest.mark.parametrize("argv, world_size, message", CASES, ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_refusal_is_one_error_line_before_any_work(argv, world_size, message, capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # nothing may be written (a bench writes nothing but its output)
    if world_size is None:
        monkeypatch.delenv("WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("WORLD_SIZE", str(world_size))
    code = main(argv)
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(errors) == 1 and errors[0].startswith(message), err
    assert not dist.is_initialized() and not any(tmp_path.iterdir())


def test_a_transformer_engine_that_does_not_load_is_one_error_line(capsys, monkeypatch, tmp_path):
    """On a GPU node (faked) whose Transformer Engine is installed but broken, the train and
    pipeline benches stop naming it, before any process group -- not a traceback mid-run."""
    from epas_megatron.bench import common
    from epas_megatron.model import fusions

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    broken = fusions.TransformerEngineProbe(True, "OSError: libcudnn.so.9: cannot open shared object file")
    # the bench's backend choice as on a GPU node (choose_backend's cases: tests/model/test_fusions.py)
    monkeypatch.setattr(common, "default_backend", lambda: fusions.choose_backend("auto", True, lambda: broken))
    code = main(["train", "--preset", "tiny"])
    err = capsys.readouterr().err
    assert code == 2 and "Transformer Engine is installed but does not load (OSError: libcudnn.so.9" in err, err
    assert not dist.is_initialized()
