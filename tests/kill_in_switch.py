"""``python -m kill_in_switch <epas-train flags>``: epas-train that kills itself (SIGKILL, no
clean-up of any kind) in the middle of its ``EPAS_TEST_KILL_IN_SWITCH``-th in-memory switch:
after the old objects are gone and the new model holds the weights, while the optimizer state is
moving (tests/training/test_resume.py)."""

import os
import signal
import sys

from epas_megatron.checkpointing import switch_adoption
from epas_megatron.train import main

calls = {"n": 0}
fill = switch_adoption.SwitchAdoption.optimizer


def optimizer_then_die(self, model, optimizer, scheduler):
    calls["n"] += 1
    if calls["n"] == int(os.environ["EPAS_TEST_KILL_IN_SWITCH"]):
        sys.stdout.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    return fill(self, model, optimizer, scheduler)


switch_adoption.SwitchAdoption.optimizer = optimizer_then_die

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
