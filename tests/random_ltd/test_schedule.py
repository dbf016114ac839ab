"""The kept-token schedule and layer-token count against DeepSpeed's own RandomLTDScheduler, and
the LayerToken LR schedule against a hand computation."""

import math

import pytest

from epas_megatron.errors import ConfigError
from epas_megatron.random_ltd.schedule import RandomLTDSchedule, parse_layer_set

CASES = [
    # num_layers, layers, seq, min, max, require_steps, seq_per_step, gbs
    (12, tuple(range(1, 11)), 2048, 128, 2048, 200, 16, 8),
    (4, (1, 2), 64, 4, 64, 10, 4, 2),
    (6, (0, 2, 3), 100, 10, 90, 7, 3, 5),  # max below the sequence; counts not multiples of the step
]


@pytest.mark.parametrize("case", CASES)
def test_matches_deepspeed_scheduler(case):
    scheduler_module = pytest.importorskip("deepspeed.runtime.data_pipeline.data_routing.scheduler")
    num_layers, layers, seq, low, high, require, step, gbs = case
    ours = RandomLTDSchedule(num_layers, layers, seq, low, high, require, step, gbs)
    config = {
        "total_layer_num": num_layers, "random_ltd_layer_num": len(layers), "global_batch_size": gbs,
        "layer_token_lr_schedule": {"enabled": False},
        "random_ltd_schedule": {"min_value": low, "max_value": high, "schedule_type": "fixed_linear",
                                "schedule_config": {"require_steps": require, "seq_per_step": step}},
    }
    theirs = scheduler_module.RandomLTDScheduler(config)
    for global_step in range(require + 20):
        theirs.update_seq(global_step)
        assert ours.kept_tokens(global_step) == theirs.get_current_seq(), global_step
        state = theirs.state_dict()
        mine = ours.state_dict(global_step + 1)
        for key in ("consumed_layer_tokens", "current_steps", "current_value", "min_value", "max_value"):
            assert mine[key] == state[key], (global_step, key)
    fresh = scheduler_module.RandomLTDScheduler(config)
    assert ours.consumed_layer_tokens(150) == fresh.get_total_layer_tokens(150)


def test_hand_computed_ramp():
    s = RandomLTDSchedule(num_layers=4, layers=(1, 2), seq_length=64, min_value=10, max_value=64,
                          require_steps=6, seq_per_step=8, global_batch_size=2)
    # floor(step/6 * 54 + 10) rounded down to a multiple of 8, capped at 64
    assert [s.kept_tokens(k) for k in range(8)] == [8, 16, 24, 32, 40, 48, 64, 64]
    assert s.kept_tokens_at_iteration(1) == 8
    assert s.layer_tokens(0) == 2 * (8 * 2 + 64 * 2)
    assert s.tokens_per_layer(0) == [64, 8, 8, 64]
    assert s.drops(5) and not s.drops(6)
    warmup, decay = s.lr_steps(2, 8)
    assert warmup == 2 * (8 * 2 + 128) + 2 * (16 * 2 + 128)
    assert decay == sum(2 * (s.kept_tokens(k) * 2 + 128) for k in range(8))


def test_layer_token_lr_reaches_peak_and_min_at_the_same_iterations():
    """Megatron's scheduler stepped by layer tokens: peak at the warm-up's end, min at the end,
    and a slower decay than per-iteration stepping while few tokens are kept."""
    import torch

    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    s = RandomLTDSchedule.from_flags(6, 128, 4, 40, min_value=16, require_steps=30)
    warmup, decay = s.lr_steps(5, 40)

    def scheduler(w, d):
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
        return OptimizerParamScheduler(opt, init_lr=0.0, max_lr=1.0, min_lr=0.1, lr_warmup_steps=w, lr_decay_steps=d,
                                       lr_decay_style="cosine", start_wd=0.0, end_wd=0.0, wd_incr_steps=1, wd_incr_style="constant"), opt

    by_tokens, opt_t = scheduler(warmup, decay)
    by_iters, opt_i = scheduler(5, 40)
    lrs_t, lrs_i = [], []
    for step in range(40):
        by_tokens.step(increment=s.layer_tokens(step))
        by_iters.step(increment=1)
        lrs_t.append(opt_t.param_groups[0]["lr"])
        lrs_i.append(opt_i.param_groups[0]["lr"])
    assert math.isclose(lrs_t[4], 1.0) and math.isclose(lrs_i[4], 1.0)
    assert math.isclose(lrs_t[-1], 0.1) and math.isclose(lrs_i[-1], 0.1)
    assert all(t > i for t, i in zip(lrs_t[5:30], lrs_i[5:30]))  # decays more slowly while dropping


def test_defaults_and_bad_flags():
    s = RandomLTDSchedule.from_flags(12, 2048, 8, 1000)
    assert s.layers == tuple(range(1, 11)) and (s.min_value, s.max_value, s.seq_per_step, s.require_steps) == (128, 2048, 16, 700)
    small = RandomLTDSchedule.from_flags(4, 64, 2, 10)
    assert (small.min_value, small.seq_per_step, small.layers) == (4, 4, (1, 2))
    assert parse_layer_set("1,3-5", 8) == (1, 3, 4, 5)
    with pytest.raises(ConfigError, match="--random-ltd-layers.*do not exist"):
        parse_layer_set("2-9", 8)
    with pytest.raises(ConfigError, match="--random-ltd-layers"):
        parse_layer_set("a-b", 8)
    with pytest.raises(ConfigError, match="--random-ltd-min-value"):
        RandomLTDSchedule.from_flags(4, 64, 2, 10, min_value=80)
    with pytest.raises(ConfigError, match="no middle layers"):
        RandomLTDSchedule.from_flags(2, 64, 2, 10)


def test_resume_check():
    s = RandomLTDSchedule.from_flags(4, 64, 2, 10)
    s.check_resume(s.state_dict(5), 5)
    other = RandomLTDSchedule.from_flags(4, 64, 2, 10, require_steps=3)
    with pytest.raises(ConfigError, match="differs"):
        other.check_resume(s.state_dict(5), 5)
    with pytest.raises(ConfigError, match="without Random-LTD"):
        s.check_resume(None, 5)
