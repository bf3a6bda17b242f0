"""The logits processors of the sampler (``sampling.process_logits``), on logits directly: each formula as
OpenAI and vLLM state it, rows of a batch independent of each other, and a row without processors untouched.
"""

from __future__ import annotations

import math

import pytest
import torch

from kvledger.errors import ConfigError
from kvledger.runtime.sampling import RowContext, SamplingParams, process_logits, sample_rows, token_logprobs

VOCAB = 8


def row(values: list[float]) -> torch.Tensor:
    return torch.tensor([values], dtype=torch.float32)


BASE = [2.0, -1.0, 0.5, 3.0, -2.0, 1.0, 0.0, -0.5]


def test_frequency_and_presence_penalties_count_only_the_output() -> None:
    """logit[t] -= frequency * count_in_output(t) + presence * (count > 0); prompt tokens do not count."""
    ctx = RowContext(tokens=[1, 3, 3, 0, 3, 5], prompt_len=3, end=6)  # output so far: 0, 3, 5
    got = process_logits(row(BASE), [SamplingParams(frequency_penalty=0.5, presence_penalty=0.25)], [ctx])[0]
    want = list(BASE)
    for t, count in {0: 1, 3: 1, 5: 1}.items():
        want[t] -= 0.5 * count + 0.25
    assert got.tolist() == pytest.approx(want)
    ctx = RowContext(tokens=[1, 2, 2, 2, 7], prompt_len=1, end=5)  # output 2, 2, 2, 7
    got = process_logits(row(BASE), [SamplingParams(frequency_penalty=-1.0)], [ctx])[0]
    want = list(BASE)
    want[2] += 3.0
    want[7] += 1.0
    assert got.tolist() == pytest.approx(want)


def test_repetition_penalty_is_hugging_faces_over_prompt_and_output() -> None:
    """Seen tokens (prompt or output): a positive logit divided by the penalty, a negative one multiplied."""
    ctx = RowContext(tokens=[0, 1, 6, 3], prompt_len=2, end=4)
    got = process_logits(row(BASE), [SamplingParams(repetition_penalty=2.0)], [ctx])[0]
    want = list(BASE)
    want[0] = 2.0 / 2
    want[1] = -1.0 * 2
    want[3] = 3.0 / 2
    want[6] = 0.0
    assert got.tolist() == pytest.approx(want)


def test_logit_bias_and_min_tokens() -> None:
    """logit_bias adds to the logit; min_tokens masks the request's stop tokens until that many are out."""
    stops = frozenset({3, 5})
    early = RowContext(tokens=[1, 2, 4], prompt_len=2, end=3, stop_token_ids=stops)  # 1 token out
    late = RowContext(tokens=[1, 2, 4, 4], prompt_len=2, end=4, stop_token_ids=stops)  # 2 out
    params = SamplingParams(min_tokens=2, logit_bias=((4, 100.0), (0, -3.5)))
    got = process_logits(torch.tensor([BASE, BASE]), [params, params], [early, late])
    want = list(BASE)
    want[4] += 100.0
    want[0] -= 3.5
    assert got[1].tolist() == pytest.approx(want)
    want[3] = want[5] = -math.inf
    assert got[0].tolist() == pytest.approx(want)


def test_rows_without_processors_are_untouched_and_logprobs_stay_raw() -> None:
    logits = torch.tensor([BASE, BASE])
    ctx = RowContext(tokens=[3], prompt_len=1, end=1)
    plain = SamplingParams()
    assert process_logits(logits, [plain, plain], [ctx, ctx]) is logits
    biased = SamplingParams(logit_bias=((4, 100.0),))
    out = process_logits(logits, [plain, biased], [ctx, ctx])
    assert out[0].tolist() == BASE and logits[1].tolist() == BASE  # the input is not changed
    tokens = sample_rows(out, [plain, biased], [(0, 0, 1), (0, 0, 1)])
    assert tokens == [3, 4]  # greedy: argmax, then the forced token
    lp = token_logprobs(logits, tokens, [0, 0])  # vLLM's raw logprobs: the model's logits, before the bias
    assert lp[1].logprob == pytest.approx(torch.log_softmax(torch.tensor(BASE, dtype=torch.float64), -1)[4].item())


class OnlyEnd:
    """A grammar whose answer is complete: only token 3 (an end token) is allowed."""

    def restrict(self, logits: torch.Tensor, branch: int, output: list[int]) -> None:
        keep = logits[3].item()
        logits.fill_(-math.inf)
        logits[3] = keep


def test_min_tokens_never_masks_everything_a_grammar_allows() -> None:
    ctx = RowContext(tokens=[1, 2], prompt_len=1, end=2, stop_token_ids=frozenset({3}))
    out = process_logits(row(BASE), [SamplingParams(min_tokens=5, constraint=OnlyEnd())], [ctx])
    assert sample_rows(out, [SamplingParams()], [(0, 0, 2)]) == [3]
    assert out[0, 3].item() == BASE[3] and torch.isinf(out[0, :3]).all()


@pytest.mark.parametrize("kwargs", [dict(presence_penalty=2.5), dict(frequency_penalty=-3), dict(repetition_penalty=0),
                                    dict(repetition_penalty=math.inf), dict(min_tokens=-1), dict(logprobs=-1),
                                    dict(logit_bias=((-1, 1.0),)), dict(logit_bias=((1, math.nan),)),
                                    dict(beam_width=2, min_tokens=1)])
def test_bad_processor_settings_are_config_errors(kwargs: dict) -> None:
    with pytest.raises(ConfigError):
        SamplingParams(**kwargs)
