"""Next-token choice: greedy, top-k / top-p filters against hand-worked examples, seeding, errors."""

import math

import pytest
import torch

from epas_megatron.errors import ConfigError
from epas_megatron.inference.sampling import SamplingParams, filter_logits, next_tokens


def test_greedy_is_argmax():
    logits = torch.tensor([[0.1, 2.0, -1.0], [3.0, 0.0, 2.9]])
    assert next_tokens(logits, SamplingParams()).tolist() == [1, 0]


def test_top_k_and_top_p_keep_the_hand_computed_sets():
    # probabilities 0.5, 0.25, 0.125, 0.125 (log-probabilities as logits)
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.125, 0.125]]))
    kept = lambda out: torch.isfinite(out[0]).nonzero().flatten().tolist()  # noqa: E731
    assert kept(filter_logits(logits, top_k=2, top_p=1.0)) == [0, 1]
    # top-p 0.5: the first token alone reaches 0.5; 0.6 needs the second; 0.8 the third.
    assert kept(filter_logits(logits, top_k=0, top_p=0.5)) == [0]
    assert kept(filter_logits(logits, top_k=0, top_p=0.6)) == [0, 1]
    assert kept(filter_logits(logits, top_k=0, top_p=0.8)) == [0, 1, 2]
    # order in the vocabulary does not matter
    shuffled = logits[:, [2, 0, 3, 1]]
    assert kept(filter_logits(shuffled, top_k=0, top_p=0.6)) == [1, 3]


def test_sampling_follows_the_distribution_and_the_seed():
    probs = torch.tensor([0.7, 0.2, 0.1])
    logits = torch.log(probs).repeat(4000, 1)
    params = SamplingParams(temperature=1.0, seed=3)
    a = next_tokens(logits, params, torch.Generator().manual_seed(3))
    b = next_tokens(logits, params, torch.Generator().manual_seed(3))
    assert torch.equal(a, b)
    freq = torch.bincount(a, minlength=3).float() / len(a)
    # 4000 draws: standard error <= sqrt(0.25 / 4000) = 0.008; allow 4 of them.
    assert torch.allclose(freq, probs, atol=4 * math.sqrt(0.25 / 4000))
    # a low temperature sharpens towards the argmax: p^(1/0.25) normalised puts 0.998 on token 0
    cold = next_tokens(logits, SamplingParams(temperature=0.25), torch.Generator().manual_seed(0))
    assert (cold == 0).float().mean() > 0.99


@pytest.mark.parametrize("kwargs,flag", [({"temperature": -1.0}, "--temperature"), ({"temperature": 1.0, "top_k": -2}, "--top-k"),
                                         ({"temperature": 1.0, "top_p": 0.0}, "--top-p"), ({"top_k": 5}, "--top-k")])
def test_bad_sampling_settings_name_the_flag(kwargs, flag):
    with pytest.raises(ConfigError, match=flag):
        SamplingParams(**kwargs)
