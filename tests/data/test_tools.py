"""The command-line tools: train a tokenizer, preprocess with it, train on the result."""

import subprocess
import sys

from epas_testing import REPO, TINY, run_trainer


def test_tokenizer_preprocess_train_pipeline(small_corpus, tmp_path):
    tok = tmp_path / "tok"
    subprocess.run([sys.executable, "tools/train_tokenizer.py", "--input", str(small_corpus), "--output-prefix", str(tok),
                    "--vocab-size", "384"], cwd=REPO, check=True, capture_output=True)
    subprocess.run([sys.executable, "tools/preprocess_data.py", "--input", str(small_corpus), "--output-prefix",
                    str(tmp_path / "corpus"), "--tokenizer-model", f"{tok}.model"], cwd=REPO, check=True, capture_output=True)
    run = run_trainer([*TINY, "--data", str(tmp_path / "corpus"), "--tokenizer-model", f"{tok}.model", "--train-iters", "3"],
                      tmp_path / "run")
    assert run.summary["iterations"] == 3
    assert "vocab 384" in run.stdout


def test_bad_tokenizer_input_exits_2(tmp_path):
    proc = subprocess.run([sys.executable, "tools/train_tokenizer.py", "--input", str(tmp_path / "missing.txt"),
                           "--output-prefix", str(tmp_path / "t")], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 2 and "--input" in proc.stderr
