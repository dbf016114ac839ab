"""The NCCL-rules transport (compat/nccl_rules.py) in real processes on gloo, against the pure model
(runtime/p2p_rules.py) on the same programs: the pipeline executor's order before its
communication plan, and two unbatched sends that cross, hang on NCCL -- plain gloo runs them (so
gloo alone proves nothing) and the transport stops them with the model's own report; a program that
pairs messages by tag gets a mismatch under the transport. The runs that move tensors for real
(the executor, the switch exchange, rebalancing, Megatron-Core's schedules) run under the
transport in every multi-process test (tests/epas_testing.py: child_environ)."""

import json
from pathlib import Path

import pytest

from epas_megatron.parallel.pipeline_schedule import build_schedule
from epas_megatron.runtime.p2p_rules import MessageMismatch, WouldDeadlock, run_programs
from epas_testing import json_lines, run_script
from p2p_orders import as_rules, crossing_programs, labels, legacy_executor_programs, tag_order_programs

pytestmark = pytest.mark.distributed

SCRIPT = Path(__file__).parent / "scripts" / "p2p_programs.py"
BYTES = 1 << 16


def run(programs, tmp_path, rules: bool) -> list[dict]:
    path = tmp_path / f"programs_{'rules' if rules else 'gloo'}.json"
    path.write_text(json.dumps(programs))
    proc = run_script(SCRIPT, [str(path), "--bytes", str(BYTES)], nproc=len(programs), timeout=120,
                      env={"EPAS_P2P_RULES": "nccl" if rules else "", "EPAS_P2P_RULES_TIMEOUT": "30"})
    return sorted(json_lines(proc.stdout, "RESULT"), key=lambda row: row["rank"])


def pure_report(programs, group: str) -> str:
    names = labels(programs)
    with pytest.raises(WouldDeadlock) as caught:
        run_programs(as_rules(programs, group, lambda text: f"tag {names.index(text)} float32[{BYTES // 4}]"))
    return str(caught.value)


@pytest.mark.parametrize("case", ["the executor before its plan (v-min, p = 2, m = 2)", "unbatched sends that cross"])
def test_a_hang_on_nccl_runs_on_gloo_and_stops_under_the_rules_with_the_models_report(case, tmp_path):
    programs = legacy_executor_programs(build_schedule("v-min", 2, 2)) if case.startswith("the executor") else crossing_programs(False)
    on_gloo = run(programs, tmp_path, rules=False)
    assert [row.get("ok") for row in on_gloo] == [True, True] and all(row["backend"] == "gloo" for row in on_gloo)
    under_rules = run(programs, tmp_path, rules=True)
    expected = pure_report(programs, under_rules[0]["group"])
    assert expected.startswith("would deadlock on NCCL:\n  rank 0: ") and "\n  rank 1: " in expected
    for row in under_rules:
        assert row["error"] == "WouldDeadlock"
        assert row["message"] == expected or row["message"].endswith(expected)  # the rank that saw it, or the other one


def test_the_same_crossing_batched_runs_under_the_rules(tmp_path):
    assert [row.get("ok") for row in run(crossing_programs(True), tmp_path, rules=True)] == [True, True]


def test_pairing_by_tag_runs_on_gloo_and_is_a_mismatch_under_the_rules(tmp_path):
    programs = tag_order_programs()
    assert [row.get("ok") for row in run(programs, tmp_path, rules=False)] == [True, True]
    with pytest.raises(MessageMismatch):
        run_programs(as_rules(programs, "g"))
    rows = run(programs, tmp_path, rules=True)
    errors = {row.get("error") for row in rows}
    assert errors <= {"MessageMismatch", "WouldDeadlock"} and "MessageMismatch" in errors
    assert any("pair rank 0's send tag 0 float32[16384] with rank 1's receive tag 1 float32[16384]" in row["message"] for row in rows)
