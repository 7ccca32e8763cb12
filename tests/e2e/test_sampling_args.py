"""The logits processors and logprobs through the whole system (a spawned Engine, drafts that
are often rejected, a tensor-parallel target, both acceptance modes): greedy output with
penalties, logit_bias and min_tokens equals transformers' generate with the matching logits
processors; logprobs equal the target alone's; prompt logprobs equal transformers' on the
same weights; n samples and seeds."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from runtime import Engine
from tests import checkpoints, launch
from tests.e2e.test_spec_sampling import (
    KW,
    PROMPT,
    SAMPLES,
    VOCAB,
    build_target,
    chi_square_p,
    exact_joint,
)

pytestmark = pytest.mark.timeout(600)

PROMPTS = [[1, 5, 9, 13, 17, 21, 25], [1, 40, 41], [1, 77, 3, 8, 60, 61, 62, 63, 64, 65, 2, 33]]
NEW = 20
STOP = 11  # a stop_token_ids entry, biased up so that min_tokens has something to hold back
ARGS = dict(
    repetition_penalty=1.4,
    presence_penalty=0.8,
    frequency_penalty=0.3,
    logit_bias={"7": 3.0, "30": -100.0, str(STOP): 2.5},
    min_tokens=6,
    stop_token_ids=[STOP],
    ignore_eos=True,
)


class PresenceFrequency:
    """vLLM's presence and frequency penalties over the output tokens (no transformers twin)."""

    def __init__(self, prompt_len: int, presence: float, frequency: float):
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids, scores):
        out = input_ids[:, self.prompt_len :]
        ones = torch.ones_like(out, dtype=scores.dtype)
        counts = torch.zeros_like(scores).scatter_add_(1, out, ones)
        return scores - self.frequency * counts - self.presence * (counts > 0).to(scores.dtype)


def hf_processed_greedy(model, prompt: list[int]) -> tuple[list[int], list[float]]:
    """transformers' greedy generate with tandem's processors in tandem's order, stopping at
    STOP; the tokens and the chosen tokens' logprobs of the raw logits."""
    from transformers import generation as g

    procs = g.LogitsProcessorList(
        [
            g.SequenceBiasLogitsProcessor({(7,): 3.0, (30,): -100.0, (STOP,): 2.5}),
            g.MinNewTokensLengthLogitsProcessor(len(prompt), 6, [STOP]),
            g.RepetitionPenaltyLogitsProcessor(1.4),
            PresenceFrequency(len(prompt), 0.8, 0.3),
        ]
    )
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=NEW,
            do_sample=False,
            logits_processor=procs,
            eos_token_id=STOP,
            pad_token_id=0,
            output_logits=True,
            return_dict_in_generate=True,
        )
    tokens = out.sequences[0, len(prompt) :].tolist()
    logprobs = [step[0].float().log_softmax(-1)[t].item() for step, t in zip(out.logits, tokens)]
    return tokens, logprobs


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    target = checkpoints.build_checkpoint(root / "target", "llama", seed=0)
    return {
        "target": target,
        "other": checkpoints.build_checkpoint(root / "other", "llama", seed=1),
        "near": checkpoints.build_near_draft(target, root / "near", noise=0.05),
    }


@pytest.fixture(scope="module")
def reference(models):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(models["target"], dtype=torch.float32)
    return model.eval(), [hf_processed_greedy(model.eval(), p) for p in PROMPTS]


@pytest.mark.parametrize(
    "draft,k,target_devices,acceptance",
    [
        ("other", 4, ["cpu:1"], "tokens"),  # most drafts rejected
        ("near", 3, ["cpu:1", "cpu:2"], "logits"),  # tensor-parallel target
    ],
)
def test_processed_greedy_and_logprobs_equal_target_alone(
    draft, k, target_devices, acceptance, models, reference, tmp_path
):
    model, want = reference
    cfg = launch.write_config(
        tmp_path / "c.yaml",
        models[draft],
        models["target"],
        ["cpu:0"],
        target_devices,
        k,
        max_prefill_tokens=16,  # prompts in chunks: prompt logprobs cross them
    )
    launch.set_speculation(cfg, acceptance=acceptance)
    with Engine.launch(cfg) as engine:
        outs = engine.generate(prompt_token_ids=PROMPTS, max_new_tokens=NEW, logprobs=2, **ARGS)
        assert [o.token_ids for o in outs] == [w[0] for w in want]
        assert any(o.finish_reason == "stop" for o in outs)  # STOP, after min_tokens
        for out, (tokens, logprobs) in zip(outs, want):
            assert out.logprobs is not None and len(out.logprobs) == len(tokens)
            got = [entry[t] for entry, t in zip(out.logprobs, tokens)]
            torch.testing.assert_close(got, logprobs, rtol=0, atol=1e-4)
            assert all(len(entry) in (2, 3) for entry in out.logprobs)  # chosen + top 2
        if acceptance == "logits":
            _prompt_logprobs_equal_transformers(engine, model)
            _n_samples_with_a_seed(engine)


def _prompt_logprobs_equal_transformers(engine, model):
    """Echo's prompt logprobs, max_new_tokens 0 included, over a prompt longer than a
    prefill chunk would be, and twice (the second would hit the prefix cache)."""
    prompt = PROMPTS[2] * 3
    with torch.no_grad():
        logp = model(torch.tensor([prompt])).logits[0].float().log_softmax(-1)
    want = [logp[i - 1, t].item() for i, t in enumerate(prompt) if i > 0]
    for max_new in (0, 1):
        out = engine.generate(prompt_token_ids=prompt, max_new_tokens=max_new, prompt_logprobs=1)
        assert len(out.token_ids) == max_new
        assert out.prompt_logprobs is not None and out.prompt_logprobs[0] is None
        got = [entry[t] for entry, t in zip(out.prompt_logprobs[1:], prompt[1:])]
        torch.testing.assert_close(got, want, rtol=0, atol=1e-4)


def _n_samples_with_a_seed(engine):
    kwargs = dict(prompt_token_ids=PROMPTS[0], max_new_tokens=8, temperature=1.0, n=3)
    outs = engine.generate(seed=7, **kwargs)
    assert len(outs) == 3 and len({tuple(o.token_ids) for o in outs}) > 1
    assert [o.token_ids for o in engine.generate(seed=7, **kwargs)] == [o.token_ids for o in outs]


SAMPLED = dict(
    temperature=1.0,
    min_p=0.02,
    repetition_penalty=1.5,
    presence_penalty=0.6,
    frequency_penalty=0.4,
    logit_bias={"3": 1.5, "5": -100.0, "9": 2.0},
)


def processed_joint(model_dir: str, prompt: list[int], top_p: float = 1.0) -> np.ndarray:
    """[V, V] probability of (first, second) generated token under the target alone with
    SAMPLED's processors (transformers' and PresenceFrequency) and warpers (and top_p)."""
    import transformers
    from transformers import generation as g

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    vocab = model.config.vocab_size
    procs = g.LogitsProcessorList(
        [
            g.SequenceBiasLogitsProcessor({(3,): 1.5, (5,): -100.0, (9,): 2.0}),
            g.RepetitionPenaltyLogitsProcessor(1.5),
            PresenceFrequency(len(prompt), 0.6, 0.4),
            g.TemperatureLogitsWarper(1.0),
            g.MinPLogitsWarper(0.02),
            *([g.TopPLogitsWarper(top_p)] if top_p < 1.0 else []),
        ]
    )
    ids = torch.tensor([prompt + [x] for x in range(vocab)])
    with torch.no_grad():
        logits = model(ids).logits  # [V, P+1, V]
    first = procs(ids[:1, :-1], logits[:1, -2]).softmax(-1)[0]  # [V]
    second = procs(ids, logits[:, -1]).softmax(-1)  # [V, V]
    return (first[:, None] * second).double().numpy()


@pytest.mark.parametrize(
    "acceptance,verification,top_p",
    [("logits", "token", 1.0), ("logits", "block", 0.9), ("tokens", "token", 1.0)],
)
def test_processed_sampling_follows_target_alone(
    acceptance, verification, top_p, tmp_path_factory, tmp_path
):
    """Either acceptance (`logits` under both verification rules, block with top-p too) with a
    random draft (its q, processed the same way, differs from the target's p): the first two
    tokens' joint distribution is the target-alone one."""
    root = tmp_path_factory.mktemp("vocab24")
    target = build_target(root)
    draft = checkpoints.build_checkpoint(root / "draft", "llama", seed=11, **KW)
    cfg = launch.write_config(
        tmp_path / "c.yaml", draft, target, ["cpu:0"], ["cpu:1"], 3, max_batch_size=256
    )
    launch.set_speculation(cfg, acceptance=acceptance, verification=verification)
    with Engine.launch(cfg) as engine:
        outs = engine.generate(
            prompt_token_ids=[PROMPT] * SAMPLES, max_new_tokens=2, seed=3, top_p=top_p, **SAMPLED
        )
    counts = np.zeros((VOCAB, VOCAB))
    for out in outs:
        counts[out.token_ids[0], out.token_ids[1]] += 1
    want = processed_joint(target, PROMPT, top_p)
    assert counts[5].sum() + counts[:, 5].sum() == 0  # logit_bias -100
    p_joint = chi_square_p(counts, want)
    p_second = chi_square_p(counts.sum(0), want.sum(0))
    assert min(p_joint, p_second) > 1e-3, (p_joint, p_second)
    unprocessed = exact_joint(target, {"temperature": 1.0})
    assert chi_square_p(counts, unprocessed) < 1e-6, "test cannot tell the processors apart"
