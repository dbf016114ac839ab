"""Two ranks: bf16 loads that must reach the fp32 main weights, at PP=2 and at DP=2 with the
distributed optimizer (main weights sharded over the ranks). Every rank checks its own main
weights right after each load without optimizer state; rank 0 prints ``CASE {json}`` with the
run's losses. Arguments: an fp32 checkpoint to start from (``--pretrained``), an output directory.
"""

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/: epas_testing and the test module

from epas_testing import train_in_process  # noqa: E402
from training.test_mixed_precision_loads import ARGS, EARLY_SWITCHES, check_main_weights  # noqa: E402

CASES = {
    "pp2-pretrained": ["--pp", "2", "--pretrained", "{base}"],
    "pp2-switch-checkpoint": ["--pp", "2", *EARLY_SWITCHES, "--epas-switch-mode", "checkpoint"],
    "dp2-pretrained": ["--use-distributed-optimizer", "--pretrained", "{base}"],
    "dp2-switch": ["--use-distributed-optimizer", *EARLY_SWITCHES],
}


def main() -> None:
    base, out = sys.argv[1], Path(sys.argv[2])
    for name, extra in CASES.items():
        check_main_weights.checked = []
        args = [*ARGS, "--precision", "bf16", *[a.format(base=base) for a in extra]]
        run = train_in_process(args, out / name, after_load=check_main_weights)
        assert run.returncode == 0, run.stdout[-3000:]
        if os.environ.get("RANK") == "0":
            print("CASE " + json.dumps({"name": name, "checked": check_main_weights.checked, "losses": run.losses}), flush=True)


if __name__ == "__main__":
    main()
