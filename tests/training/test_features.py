"""The training-feature hooks (epas_megatron.training.features) and Random-LTD's implementation of
them (epas_megatron.training.random_ltd), against values worked out by hand from DeepSpeed's
schedule and against the RandomLTDSchedule they delegate to; how hooks combine over features."""

from types import SimpleNamespace

import pytest

from epas_megatron.checkpointing.metadata import CheckpointMeta
from epas_megatron.config.cli import parse_config
from epas_megatron.errors import ConfigError
from epas_megatron.random_ltd.schedule import RandomLTDSchedule
from epas_megatron.training.features import TrainingFeature, TrainingFeatures
from epas_megatron.training.random_ltd import RandomLTDFeature
from epas_megatron.validation import resolve_run

# 4 layers, layers 1-2 drop, seq 64, batch 2. Kept: floor(step/4 * 48 + 16) rounded down to a
# multiple of 16 -> 16, 16 (28), 32 (40), 48 (52), 64 at steps 0..4. Layer tokens of a step:
# 2 * (kept * 2 + 64 * 2) -> 320, 320, 384, 448, 512, 512, ...
SCHEDULE = RandomLTDSchedule(num_layers=4, layers=(1, 2), seq_length=64, min_value=16, max_value=64, require_steps=4,
                             seq_per_step=16, global_batch_size=2)
KEPT = [16, 16, 32, 48, 64, 64]
LAYER_TOKENS = [320, 320, 384, 448, 512, 512]


def feature(layer_token_lr=True):
    return RandomLTDFeature(SCHEDULE, layer_token_lr=layer_token_lr)


def only(*features):
    return TrainingFeatures((RandomLTDFeature,), tuple(features))


def chunk(kept=None):
    """A DDP-wrapped model chunk as set_kept_tokens sees it: module.module.decoder."""
    return SimpleNamespace(module=SimpleNamespace(decoder=SimpleNamespace(kept_tokens=kept)))


def test_the_hand_worked_schedule():
    assert [SCHEDULE.kept_tokens(step) for step in range(6)] == KEPT
    assert [SCHEDULE.layer_tokens(step) for step in range(6)] == LAYER_TOKENS


def test_before_step_sets_the_kept_tokens_of_the_step_on_every_chunk():
    model = [chunk(), chunk(64)]
    only(feature()).before_step(model, 2)  # the step of iteration 3
    assert [c.module.decoder.kept_tokens for c in model] == [32, 32]
    only(feature()).before_step(model, 0)
    assert [c.module.decoder.kept_tokens for c in model] == [16, 16]
    only().before_step(model, 3)  # no feature: the chunks are left alone
    assert [c.module.decoder.kept_tokens for c in model] == [16, 16]


def test_layer_token_lr_advances_by_the_steps_layer_tokens():
    assert [only(feature()).lr_increment(step) for step in range(6)] == LAYER_TOKENS
    assert only(feature(layer_token_lr=False)).lr_increment(2) == 1
    assert only().lr_increment(2) == 1
    # warm-up 2 iterations: 320 + 320; decay 6: 320 + 320 + 384 + 448 + 512 + 512
    assert only(feature()).lr_schedule_units(2, 6) == (640, 2496) == SCHEDULE.lr_steps(2, 6)
    assert only(feature(layer_token_lr=False)).lr_schedule_units(2, 6) is None
    assert only().lr_schedule_units(2, 6) is None


def test_flop_tokens_of_a_1_based_iteration():
    assert only(feature()).flop_tokens(3) == [64, 32, 32, 64]  # step 2: the dropping layers keep 32
    assert only(feature()).flop_tokens(1) == [64, 16, 16, 64]
    assert only().flop_tokens(3) is None


def test_record_after_an_iteration():
    record = only(feature()).record(3)
    # kept tokens of iteration 3 (step 2); layer tokens of steps 0-2; 384 / (batch 2 x 4 layers)
    assert record == {"random_ltd_kept_tokens": 32, "consumed_layer_tokens": 1024, "layer_averaged_seq_length": 48.0}
    assert only().record(3) == {}
    assert only(feature()).summary(3) == {"random_ltd": record}
    assert only(feature()).summary(0) == {}  # nothing trained yet


def test_checkpoint_metadata_has_a_record_while_on():
    state = only(feature()).checkpoint_meta(3)["random_ltd"]
    assert state == SCHEDULE.state_dict(3)
    assert (state["consumed_layer_tokens"], state["current_steps"], state["current_value"]) == (1024, 2, 32)
    assert only().checkpoint_meta(3) == {}


def test_describe():
    assert only(feature()).describe(10) == [SCHEDULE.describe(10) + "; LayerToken LR"]
    assert only(feature(layer_token_lr=False)).describe(10) == [SCHEDULE.describe(10)]
    assert only().describe(10) == []


def meta(iteration, random_ltd):
    return CheckpointMeta(model={}, iteration=iteration, features={} if random_ltd is None else {"random_ltd": random_ltd})


def test_resume_checks():
    only(feature()).check_resume(meta(3, SCHEDULE.state_dict(3)))
    only().check_resume(meta(3, None))
    with pytest.raises(ConfigError, match="current_steps: checkpoint 1, this run 2"):
        only(feature()).check_resume(meta(3, SCHEDULE.state_dict(2)))
    with pytest.raises(ConfigError, match="trained without Random-LTD"):
        only(feature()).check_resume(meta(3, None))
    with pytest.raises(ConfigError) as error:
        only().check_resume(meta(3, SCHEDULE.state_dict(3)))
    assert str(error.value) == ("--load: the checkpoint at iteration 3 was trained with --random-ltd; resume with the same "
                                "--random-ltd-* flags (or start from its weights with --pretrained)")


def test_from_run(tmp_path):
    base = ["--preset", "tiny", "--output-dir", str(tmp_path / "out"), "--train-iters", "100", "--seed", "5"]
    run = resolve_run(parse_config([*base, "--random-ltd", "--random-ltd-kernels", "torch", "--no-random-ltd-layer-token-lr"]),
                      world_size=1)
    features = TrainingFeatures.for_run(run, (RandomLTDFeature,))
    assert list(features) == [RandomLTDFeature(RandomLTDFeature.schedule_of(run.cfg), layer_token_lr=False)]
    plain = TrainingFeatures.for_run(resolve_run(parse_config(base), world_size=1), (RandomLTDFeature,))
    assert len(plain) == 0 and plain.checkpoint_meta(1) == {}


class Doubler(TrainingFeature):
    name, flag = "doubler", "--doubler"

    def lr_increment(self, step):
        return 2 * step

    def record(self, iteration):
        return {"consumed_layer_tokens": iteration}


def test_single_values_come_from_at_most_one_feature():
    both = TrainingFeatures((RandomLTDFeature, Doubler), (feature(), Doubler()))
    with pytest.raises(ValueError, match="lr_increment: supplied by more than one feature"):
        both.lr_increment(2)
    one = TrainingFeatures((RandomLTDFeature, Doubler), (feature(layer_token_lr=False), Doubler()))
    assert one.lr_increment(3) == 6  # Random-LTD without LayerToken LR supplies none
    assert one.flop_tokens(3) == [64, 32, 32, 64]  # the Doubler supplies none
    with pytest.raises(ValueError, match=r"record: doubler supplies \['consumed_layer_tokens'\]"):
        one.record(3)
    assert one.checkpoint_meta(3) == {"random_ltd": SCHEDULE.state_dict(3)}  # the Doubler writes no record
