"""The logits processors (runtime.speculation.processors) against transformers' own processors
and against themselves one position at a time: a verify window's position j sees the
committed tokens and the first j drafts, exactly."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    TemperatureLogitsWarper,
)

from runtime.control.commands import Sampling
from runtime.speculation.choose import BatchSampling
from runtime.speculation.processors import window_counts

V = 40
EOS = 3


class PresenceFrequency:
    """vLLM's presence and frequency penalties over the output tokens (no transformers twin)."""

    def __init__(self, prompt_len: int, presence: float, frequency: float):
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        out = input_ids[:, self.prompt_len :]
        counts = torch.zeros_like(scores).scatter_add_(
            1, out, torch.ones_like(out, dtype=scores.dtype)
        )
        return scores - self.frequency * counts - self.presence * (counts > 0).to(scores.dtype)


def history(prompt: list[int], output: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    counts = torch.zeros(1, V)
    for t in output:
        counts[0, t] += 1
    seen = torch.zeros(1, V, dtype=torch.bool)
    seen[0, prompt + output] = True
    return counts, seen


def reference(prompt, output, logits, bias, min_tokens, rep, pres, freq):
    """transformers' processors in tandem's order on one position's logits [V]."""
    ids = torch.tensor([prompt + output])
    scores = logits[None].clone()
    procs = [
        SequenceBiasLogitsProcessor({(t,): b for t, b in bias.items()}),
        MinNewTokensLengthLogitsProcessor(len(prompt), min_tokens, [EOS, 7]),
        RepetitionPenaltyLogitsProcessor(rep),
        PresenceFrequency(len(prompt), pres, freq),
    ]
    for proc in procs:
        scores = proc(ids, scores)
    return scores[0]


def sampling(prompt, output, bias, min_tokens, rep, pres, freq, temperature=0.0, min_p=0.0):
    params = Sampling(
        temperature, 0, 1.0, 0, min_p=min_p, bias_ids=list(bias), bias_values=list(bias.values()),
        min_tokens=min_tokens, stop_ids=[EOS, 7], output_start=len(prompt), repetition=rep,
        frequency=freq, presence=pres,
    )  # fmt: skip
    return BatchSampling.of([params], torch.device("cpu"), V, history(prompt, output))


@pytest.mark.parametrize("seed", range(6))
def test_one_position_equals_transformers_processors(seed):
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, V, (7,), generator=g).tolist()
    output = torch.randint(0, V, (seed,), generator=g).tolist()
    logits = torch.randn(V, generator=g) * 3
    bias = {5: 4.0, 11: -100.0, 2: 0.5}
    args = (bias, 4, 1.3, 0.7, -0.4)
    got = sampling(prompt, output, *args).process(
        logits[None, None], torch.tensor([[len(prompt) + len(output)]])
    )[0, 0]
    want = reference(prompt, output, logits, *args)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    assert (got == float("-inf")).any() == (len(output) < 4)


def test_a_window_position_sees_the_drafts_before_it():
    """Processing k + 1 positions at once with the drafts as the window equals processing
    each position alone with the drafts before it committed."""
    g = torch.Generator().manual_seed(1)
    prompt, output = [1, 2, 5, 5], [9, 5]
    drafts = torch.tensor([[5, 9, EOS, 5, 12]])
    logits = torch.randn(1, 6, V, generator=g) * 2
    args = ({5: 1.5}, 5, 1.2, 0.3, 0.6)
    start = len(prompt) + len(output)
    index = start + torch.arange(6)[None]
    together = sampling(prompt, output, *args).process(logits, index, drafts)
    for j in range(6):
        alone_history = output + drafts[0, :j].tolist()
        want = reference(prompt, alone_history, logits[0, j], *args)
        torch.testing.assert_close(together[0, j], want, rtol=0, atol=1e-5)


def test_window_counts_of_a_draft_step():
    """One position after m proposals: all m count; k + 1 positions after k: j count."""
    window = torch.tensor([[4, 4, 1]])
    one = window_counts(window, 1, 6)
    assert one[0, 0].tolist() == [0, 1, 0, 0, 2, 0]
    many = window_counts(window, 4, 6)
    assert [row[4].item() for row in many[0]] == [0, 1, 2, 2]
    with pytest.raises(ValueError):
        window_counts(window, 5, 6)


def test_min_p_equals_transformers_after_temperature():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(1, 1, V, generator=g) * 4
    batch = sampling([1], [], {}, 0, 1.0, 0.0, 0.0, temperature=0.7, min_p=0.2)
    got = batch.warp(batch.process(logits, torch.tensor([[1]])))[0, 0]
    scores = TemperatureLogitsWarper(0.7)(None, logits[0].clone())
    scores = MinPLogitsWarper(0.2)(None, scores)
    torch.testing.assert_close(got, scores.softmax(-1)[0], rtol=0, atol=1e-6)


def test_rows_without_processors_are_untouched():
    """A batch of a penalised row and a plain one: the plain row's logits pass unchanged,
    and a batch with no processed row skips the work (returns its logits)."""
    plain = Sampling(0.0, 0, 1.0, 0)
    penalised = Sampling(0.0, 0, 1.0, 0, repetition=2.0, prompt=[1])
    counts, seen = history([1, 2], [3])
    batch = BatchSampling.of(
        [penalised, plain], torch.device("cpu"), V, (counts.repeat(2, 1), seen.repeat(2, 1))
    )
    logits = torch.randn(2, 3, V)
    out = batch.process(
        logits, torch.tensor([[5, 6, 7], [5, 6, 7]]), torch.tensor([[1, 2], [1, 2]])
    )
    torch.testing.assert_close(out[1], logits[1])
    assert not torch.equal(out[0], logits[0])
    bare = BatchSampling.of([plain, plain], torch.device("cpu"), V)
    assert bare.process(logits, torch.zeros(2, 3, dtype=torch.long)) is logits


def test_penalties_need_the_history():
    with pytest.raises(ValueError, match="history"):
        BatchSampling.of([Sampling(0.0, 0, 1.0, 0, presence=1.0)], torch.device("cpu"), V)
