"""Overlap on against overlap off, interleaved: both engines up at once (idle workers block on
their sockets), one greedy call of each in turn per prompt, medians. Side by side in time,
so a busy or drifting host affects both alike (`tandem bench` runs the modes one after the
other). The figures in docs/configuration.md, "Overlapped speculation":

    python -c "from runtime.models.loading.synthetic import build_pair; \
               build_pair('/tmp/ov', 'small', 2, eps=0.045)"
    TANDEM_CPU_AFFINITY=1 python examples/cpu/overlap_bench.py /tmp/ov --draft-len 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from runtime.api.engine import Engine


def engine_config(pair: str, draft_len, overlap: bool) -> dict:
    return {
        "draft": {"model": f"{pair}/draft", "devices": ["cpu:0"], "dtype": "bfloat16"},
        "target": {"model": f"{pair}/target", "devices": ["cpu:1"], "dtype": "bfloat16"},
        "speculation": {"draft_len": draft_len, "overlap": overlap},
        "runtime": {"max_batch_size": 1, "max_seq_len": 1024},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "pair", help="folder with draft/ and target/ (runtime.models.loading.synthetic)"
    )
    ap.add_argument("--draft-len", default="2", help="an integer or auto (default 2)")
    ap.add_argument("--calls", type=int, default=5, help="prompts, one call each per mode")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=96)
    a = ap.parse_args()
    draft_len = a.draft_len if a.draft_len == "auto" else int(a.draft_len)
    vocab = json.loads((Path(a.pair) / "target" / "config.json").read_text())["vocab_size"]
    gen = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(0, vocab, (a.prompt_len,), generator=gen).tolist() for _ in range(a.calls)
    ]
    engines = {on: Engine.launch(engine_config(a.pair, draft_len, on)) for on in (True, False)}
    rates, stats = {True: [], False: []}, {True: [], False: []}
    try:
        for engine in engines.values():  # warm-up
            engine.generate(prompt_token_ids=prompts[0], max_new_tokens=16, temperature=0)
        for i, prompt in enumerate(prompts):
            for on in (True, False) if i % 2 == 0 else (False, True):
                start = time.perf_counter()
                out = engines[on].generate(
                    prompt_token_ids=prompt, max_new_tokens=a.new_tokens, temperature=0
                )
                rates[on].append(len(out.token_ids) / (time.perf_counter() - start))
                stats[on].append(out.stats)
    finally:
        for engine in engines.values():
            engine.close()
    for on in (True, False):
        mean = lambda key, on=on: statistics.mean(s[key] for s in stats[on])  # noqa: E731
        alpha = sum(sum(s["accepted_per_position"]) for s in stats[on]) / sum(
            s["tested_draft_tokens"] for s in stats[on]
        )  # kept / tested, as the bench
        print(
            f"overlap {'on ' if on else 'off'}: {statistics.median(rates[on]):.1f} tokens/s "
            f"(median; {min(rates[on]):.1f}-{max(rates[on]):.1f}), alpha {alpha:.3f}, "
            f"acceptance {mean('acceptance_rate'):.3f}, "
            f"tokens/round {mean('mean_accepted_tokens'):.2f}, "
            f"rounds {mean('rounds'):.1f}, overlapped {mean('overlapped_rounds'):.1f}"
        )
    paired = [x / y for x, y in zip(rates[True], rates[False])]
    print(
        f"on / off: {statistics.median(rates[True]) / statistics.median(rates[False]):.2f}x "
        f"(medians); per call (same prompt) median {statistics.median(paired):.2f}x: "
        f"{', '.join(f'{r:.2f}' for r in paired)}"
    )


if __name__ == "__main__":
    main()
