"""A checkpoint written by an earlier commit still loads, and resumes to the losses that commit
itself reached after resuming it.

``tests/fixtures/checkpoint_406e8ca`` was saved by commit 406e8ca (before the GPU-path and
build-plan changes) at iteration 7 with the sharing region [2, 3]; ``expected.json`` holds that
commit's own losses and gradient norms for iterations 8 and 9 when resumed from it. 406e8ca ran
Megatron's unfused attention and today's default is SDPA, hence a relative tolerance, not
bit-identity.
"""

import json
import os
import platform
import shutil
from pathlib import Path

import pytest

from epas_megatron.data.corpus import default_corpus_path, file_sha256
from epas_testing import TINY, assert_close, run_trainer

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "checkpoint_406e8ca"
ARGS = [*TINY, "--global-batch-size", "4", "--micro-batch-size", "2", "--epas-target-layers", "2",
        "--epas-interval", "3", "--seed", "3", "--init-method-std", "0.1", "--train-iters", "9"]


def test_checkpoint_from_406e8ca_resumes_to_that_commits_losses(tmp_path):
    expected = json.loads((FIXTURE / "expected.json").read_text())
    corpus = file_sha256(default_corpus_path(Path(os.environ["EPAS_CACHE_DIR"])))[:16]
    if corpus != expected["corpus_sha256_16"]:
        pytest.skip(f"this Python ({platform.python_version()}) builds another embedded corpus ({corpus}) than the one the "
                    f"expected losses were trained on ({expected['corpus_sha256_16']}, Python {expected['python']}): the "
                    f"numbers cannot match; rebuild them with the recipe in {FIXTURE / 'README.md'}")
    checkpoints = tmp_path / "old_checkpoints"
    shutil.copytree(FIXTURE, checkpoints, ignore=shutil.ignore_patterns("expected.json"))
    run = run_trainer([*ARGS, "--load", str(checkpoints)], tmp_path / "run")
    reference = expected["resumed_by_406e8ca"]
    assert_close(run.losses, {int(k): v for k, v in reference["lm_loss"].items()}, 1e-5, "lm loss after resume")
    assert_close(run.grad_norms, {int(k): v for k, v in reference["grad_norm"].items()}, 1e-4, "grad norm after resume")
    assert run.switches == []  # the region [2, 3] came from the checkpoint; no switch was left to make
    meta = json.loads((tmp_path / "run" / "checkpoints" / "iter_0000009" / "run_meta.json").read_text())
    assert meta["sharing_layers"] == expected["sharing_layers"]
