"""The README's commands: the main job (shortened by flags) trains with EPAS switching, and its
loss falls; the commands that read its checkpoint (evaluation, generation, Hugging Face export)
run as written on it; the pipeline example trains; the test command is what .ci/run runs."""

import json
import re
import shlex

import pytest

from epas_testing import COMMANDS_BY_SCRIPT, REPO, _main_in_process, run_trainer


def readme_commands() -> list[str]:
    text = (REPO / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", text, flags=re.S)
    return [line.strip() for block in blocks[:2] for line in block.strip().splitlines()]


def test_ci_runs_the_readme_test_command():
    test_command = readme_commands()[1]
    assert test_command.startswith("bash tools/setup_env.sh && ")
    assert test_command in (REPO / ".ci" / "run").read_text()


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    """The README's main job, shortened by flags (24 iterations, a checkpoint at the end)."""
    main_command = readme_commands()[0]
    setup, train = [part.strip() for part in main_command.split("&&")]
    assert setup == "bash tools/setup_env.sh"
    argv = shlex.split(train)
    assert argv[0].endswith("epas-train")
    args = [a for a in argv[1:]]
    out_flag = args.index("--output-dir")
    del args[out_flag:out_flag + 2]
    shorten = ["--train-iters", "24", "--seq-length", "64", "--global-batch-size", "4", "--micro-batch-size", "4",
               "--lr-warmup-iters", "2", "--epas-interval", "4", "--eval-interval", "12", "--log-interval", "1",
               "--save-interval", "24"]
    return run_trainer([*args, *shorten], tmp_path_factory.mktemp("readme") / "demo")


def test_main_command_trains_with_epas_switches_and_loss_falls(demo_run):
    run = demo_run
    # The demo config has EPAS on: 4 of the small model's 8 layers switch, one every 4 iterations here.
    assert [s["sharing_layers"] for s in run.switches] == [[7], [6, 7], [5, 6, 7], [4, 5, 6, 7]]
    assert "EPAS switch at iteration 4: sharing layers [7]" in run.stdout
    assert "EPAS schedule" in run.stdout
    losses = run.losses
    first, last = sum(losses[i] for i in range(1, 5)) / 4, sum(losses[i] for i in range(21, 25)) / 4
    assert last < first - 0.5, (first, last)
    assert run.summary["iterations"] == 24 and run.summary["final_valid_lm_loss"] is not None
    # ... and validates the same weights at regions 0, half the region in training and the region in training.
    valid = {(m["iteration"], m["region"]) for m in run.metrics if m.get("kind") == "valid"}
    assert valid == {(12, 0), (12, 1), (12, 3), (24, 0), (24, 2), (24, 4)}


def _readme_lines() -> list[str]:
    text = (REPO / "README.md").read_text()
    return [line.strip() for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S) for line in block.splitlines()]


def test_the_readme_pipeline_example_runs(tmp_path):
    """The README's pipeline example (two ranks, a V schedule, the tiny preset) as written, ended
    after 12 iterations (its refusals -- too few micro-batches, a schedule the layers cannot run --
    come before the first step): it trains under V-Min on both ranks."""
    line = next(line for line in _readme_lines() if "torchrun" in line and "-m epas_megatron.train" in line)
    argv = shlex.split(line)
    nproc = int(argv[argv.index("--nproc-per-node") + 1])
    args = argv[argv.index("epas_megatron.train") + 1:]
    out_flag = args.index("--output-dir")
    del args[out_flag:out_flag + 2]
    assert nproc == 2 and "--pipeline-schedule" in args
    run = run_trainer([*args, "--train-iters", "12"], tmp_path / "pipeline", nproc=nproc)
    assert run.summary["iterations"] == 12 and run.returncode == 0
    schedule = args[args.index("--pipeline-schedule") + 1]
    assert f"({schedule}, V placement" in run.stdout, run.stdout[-2000:]


def test_the_readme_commands_on_the_demo_checkpoint_run(demo_run, tmp_path):
    """The README's epas-eval, epas-generate and epas-convert hf-export lines, as written but for
    the run directory (``runs/demo`` is the test's) and the export's, each run by its command's
    own ``main``: the evaluation reports every region asked for, generation continues the prompt,
    the export writes a Hugging Face model."""
    lines = [line for line in _readme_lines() if "--load runs/demo/checkpoints" in line]
    assert {shlex.split(line)[0].rsplit("/", 1)[-1] for line in lines} == {"epas-eval", "epas-generate", "epas-convert"}
    for line in lines:
        argv = [word.replace("runs/demo", str(demo_run.output_dir)).replace("hf/demo", str(tmp_path / "hf"))
                for word in shlex.split(line)]
        script = argv[0].rsplit("/", 1)[-1]
        returncode, stdout, stderr = _main_in_process(argv[1:], module=COMMANDS_BY_SCRIPT[script])
        assert returncode == 0, f"{line}\n{stdout[-2000:]}\n{stderr[-2000:]}"
        if script == "epas-eval":
            payload = json.loads(next(x for x in stdout.splitlines() if x.startswith("EVAL "))[5:])
            assert [r["region"] for r in payload["results"]] == [0, 2, 4], payload
        elif script == "epas-generate":
            # "N tokens in S s": the prompt continued (a short demo model may stop at its end-of-text)
            generated = re.search(r"^(\d+) tokens in ", stderr, flags=re.M)
            assert stdout.startswith(argv[argv.index("--prompt") + 1]) and generated and int(generated.group(1)) >= 1, stderr
        else:
            assert (tmp_path / "hf" / "config.json").is_file() and any((tmp_path / "hf").glob("*.safetensors"))
