"""Speculative sampling through the whole system follows the target's own distribution.

A 24-token-vocabulary target and a different random draft; thousands of samples of the first
two (three, four) generated tokens per setting; chi-square against the exact distribution
computed from the target alone (transformers' logits and warpers). A control checks the same
samples against the draft's distribution and must reject it, so the test would notice the
draft leaking through. Both rules of `logits` acceptance run: token by token and as a block
(speculation.verification).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import stats

from runtime import Engine
from tests import checkpoints, launch

pytestmark = pytest.mark.timeout(600)

VOCAB = 24
PROMPT = [1, 7, 3, 12, 5]
SAMPLES = 3000
SETTINGS = [
    {"temperature": 1.0},
    {"temperature": 0.7, "top_k": 8},
    {"temperature": 1.0, "top_p": 0.8},
    {"temperature": 0.7, "top_k": 12, "top_p": 0.9},
]


KW = dict(
    vocab_size=VOCAB,
    initializer_range=0.08,
    eos_token_id=None,
    bos_token_id=None,
    pad_token_id=None,
)


def build_target(root) -> str:
    """The 24-token-vocabulary target of these tests (test_overlap_sampling's too)."""
    return checkpoints.build_checkpoint(root / "target", "llama", seed=10, **KW)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("vocab24")
    target = build_target(root)
    draft = checkpoints.build_checkpoint(root / "draft", "llama", seed=11, **KW)
    # a draft that agrees often (alpha about 0.8 at temperature 1) yet is told apart: with
    # draft_len 1 under `logits` acceptance most first windows are kept, so the second token
    # is the overlapped round's, verified with the target's held logits
    # (runtime.worker.overlap)
    near = checkpoints.build_near_draft(target, root / "near", noise=0.3)
    return {"random": draft, "near": near}, target


def model_and_warpers(model_dir: str, setting: dict):
    """The model (float32, transformers) and transformers' warpers of `setting`."""
    import transformers
    from transformers.generation import logits_process as lp

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    warpers = lp.LogitsProcessorList()
    warpers.append(lp.TemperatureLogitsWarper(setting["temperature"]))
    if setting.get("top_k"):
        warpers.append(lp.TopKLogitsWarper(setting["top_k"]))
    if setting.get("top_p", 1.0) < 1.0:
        warpers.append(lp.TopPLogitsWarper(setting["top_p"]))
    return model, warpers


def exact_joint(
    model_dir: str, setting: dict, prompt: list[int] = PROMPT, vocab: int = VOCAB
) -> np.ndarray:
    """[V, V] probability of (first, second) generated token after `prompt` under the model
    alone (V = vocab, the model's vocab_size)."""
    model, warpers = model_and_warpers(model_dir, setting)
    ids = torch.tensor([prompt + [x] for x in range(vocab)])
    with torch.no_grad():
        logits = model(ids).logits  # [V, P+1, V]
    first = warpers(ids[:1, :-1], logits[:1, -2]).softmax(-1)[0]  # [V]
    second = warpers(ids, logits[:, -1]).softmax(-1)  # [V, V]
    return (first[:, None] * second).double().numpy()


def exact_tokens(model_dir: str, setting: dict, n: int) -> np.ndarray:
    """[V] * n probability of the first n generated tokens after PROMPT under the model alone
    (one forward over every prefix of each length)."""
    model, warpers = model_and_warpers(model_dir, setting)
    joint = torch.ones(1, dtype=torch.float64)  # [V ** m] over the prefixes of length m
    for m in range(n):
        ranges = [torch.arange(VOCAB)] * m
        prefixes = torch.cartesian_prod(*ranges).view(VOCAB**m, m) if m else torch.zeros(1, 0)
        prefixes = prefixes.long()
        ids = torch.cat([torch.tensor(PROMPT).expand(len(prefixes), -1), prefixes], 1)
        with torch.no_grad():
            logits = model(ids).logits[:, -1]  # [V ** m, V]
        probs = warpers(ids, logits).softmax(-1).double()  # [V ** m, V]
        joint = (joint[:, None] * probs).flatten()
    return joint.view(*[VOCAB] * n).numpy()


def follows_target(counts: np.ndarray, target_p: np.ndarray) -> list[float]:
    """p-values of n-token samples [V] * n against the exact target_p: each consecutive pair
    and each single token."""
    n = counts.ndim
    pairs = [tuple(j for j in range(n) if j not in (i, i + 1)) for i in range(n - 1)]
    singles = [tuple(j for j in range(n) if j != i) for i in range(n)]
    return [chi_square_p(counts.sum(axis=a), target_p.sum(axis=a)) for a in pairs + singles]


def chi_square_p(counts: np.ndarray, probs: np.ndarray) -> float:
    """Pearson chi-square p-value; cells expecting < 5 samples are pooled into one."""
    counts, probs = counts.ravel(), probs.ravel() / probs.sum()
    expected = probs * counts.sum()
    small = expected < 5
    if counts[probs == 0].sum() > 0:
        return 0.0  # a sample where the model gives zero
    obs = np.append(counts[~small], counts[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    keep = exp > 0
    exp = exp[keep] * obs[keep].sum() / exp[keep].sum()
    return float(stats.chisquare(obs[keep], exp).pvalue)


def sample_pairs(
    engine, setting: dict, seed: int, new_tokens: int = 2, counted: int = 2
) -> tuple[np.ndarray, int]:
    """Counts [V] * counted of the first `counted` generated tokens, and the rounds
    overlapped. The first token comes with the prefill, the next from a round; a later one
    may come from a second round, whose window the draft drafted during the first's verify
    (overlap)."""
    outs = engine.generate(
        prompt_token_ids=[PROMPT] * SAMPLES, max_new_tokens=new_tokens, seed=seed, **setting
    )
    counts = np.zeros([VOCAB] * counted)
    for out in outs:
        assert len(out.token_ids) == new_tokens
        counts[tuple(out.token_ids[:counted])] += 1
    return counts, sum(out.stats["overlapped_rounds"] for out in outs)


@pytest.mark.parametrize(
    "acceptance,verification,draft_devices,target_devices,draft_kind,k,budget",
    [
        # runtime.max_prefill_tokens 23: most prompts are prefilled over two scheduler steps
        # (23 = 4 x 5 + 3), beside the rounds of the requests already running
        ("tokens", "token", ["cpu:0"], ["cpu:1"], "random", 3, 23),
        ("logits", "token", ["cpu:0"], ["cpu:1"], "random", 3, None),
        # draft TP 1, target TP 2; block verification, four tokens (the second to fourth
        # from one window, or the later ones from the next)
        ("logits", "block", ["cpu:0"], ["cpu:1", "cpu:2"], "random", 3, None),
        ("tokens", "token", ["cpu:0", "cpu:1"], ["cpu:2"], "random", 3, None),  # draft TP 2
        # overlapped rounds kept (held logits; `tokens` keeps the bonus: test_overlap_sampling)
        ("logits", "token", ["cpu:0"], ["cpu:1"], "near", 1, None),
        # block verification of two drafts, overlapped: a kept window's next window (drafted
        # during the verify, its samples keyed by that window) gives the fourth token
        ("logits", "block", ["cpu:0"], ["cpu:1"], "near", 2, None),
    ],
)
def test_sampled_output_follows_target(
    acceptance, verification, draft_devices, target_devices, draft_kind, k, budget, pair, tmp_path
):
    drafts, target = pair
    draft = drafts[draft_kind]
    cfg = launch.write_config(
        tmp_path / "c.yaml",
        draft,
        target,
        draft_devices,
        target_devices,
        draft_len=k,
        max_batch_size=256,
        max_prefill_tokens=budget,
    )
    launch.set_speculation(cfg, acceptance=acceptance, verification=verification)
    with Engine.launch(cfg) as engine:
        # each acceptance mode meets every setting once: the one-device-each layouts plain
        # temperature and top-k with top-p, the TP layouts top-k and top-p alone
        tp = len(draft_devices + target_devices) > 2
        settings = SETTINGS[1:3] if tp else [SETTINGS[0], SETTINGS[3]]
        settings = settings[:1] if draft_kind == "near" else settings
        counted = {"token": 2, "block": 4}[verification]  # tokens whose joint is checked
        for i, setting in enumerate(settings):
            counts, overlapped = sample_pairs(
                engine, setting, 1000 * i, max(counted, 3 if draft_kind == "near" else 2), counted
            )
            if draft_kind == "near":  # disjoint devices overlap (speculation.overlap auto)
                assert overlapped > SAMPLES // 4, overlapped
            target_p = exact_tokens(target, setting, counted)
            p_values = follows_target(counts, target_p)
            assert min(p_values) > 1e-3, (setting, p_values)
            first_two = tuple(range(2, counted))
            draft_p = exact_joint(draft, setting)
            assert chi_square_p(counts.sum(first_two), draft_p) < 1e-6, "draft not told apart"
        again = engine.generate(prompt_token_ids=PROMPT, max_new_tokens=6, seed=5, **SETTINGS[0])
        assert (
            engine.generate(
                prompt_token_ids=PROMPT, max_new_tokens=6, seed=5, **SETTINGS[0]
            ).token_ids
            == again.token_ids
        )


@pytest.mark.parametrize("arch", ["qwen3", "gemma3_text"])
def test_family_sampled_output_follows_target(arch, tmp_path):
    """Issue 37's native families sample the target's own distribution too (`logits`
    acceptance, top-k and top-p): Qwen3's q/k norms, Gemma 3's norms, soft-capped logits and
    sliding layers on both sides of the speculation."""
    target = checkpoints.build_checkpoint(tmp_path / "target", arch, seed=10, **KW)
    draft = checkpoints.build_checkpoint(tmp_path / "draft", arch, seed=11, **KW)
    cfg = launch.write_config(
        tmp_path / "c.yaml", draft, target, ["cpu:0"], ["cpu:1"], draft_len=3, max_batch_size=256
    )
    launch.set_speculation(cfg, acceptance="logits")
    setting = SETTINGS[3]
    with Engine.launch(cfg) as engine:
        counts, _ = sample_pairs(engine, setting, seed=77)
    target_p, draft_p = exact_joint(target, setting), exact_joint(draft, setting)
    p_joint = chi_square_p(counts, target_p)
    p_first = chi_square_p(counts.sum(1), target_p.sum(1))
    p_second = chi_square_p(counts.sum(0), target_p.sum(0))
    assert min(p_joint, p_first, p_second) > 1e-3, (p_joint, p_first, p_second)
    assert chi_square_p(counts, draft_p) < 1e-6, "test cannot tell draft from target"
