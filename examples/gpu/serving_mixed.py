"""Mixed serving traffic (issue 36): STREAMS steady streams decode while a LONG_PROMPT_LEN-token
prompt arrives every LONG_EVERY seconds, through `runtime.Engine` on a synthetic pair (greedy,
`draft_len: auto`, prefix caching on, runtime.max_prefill_tokens = --max-prefill-tokens).

One Engine (max_batch_size STREAMS + LONG_COUNT, so nothing waits for a row), warmed up with
one short generate and one untimed long request. Then one `Engine.stream` call carries the
STREAMS prompts (STREAM_PROMPT_LEN random tokens, STREAM_NEW_TOKENS each: enough to outlast the
run); once every stream has its first token, a baseline window of BASELINE seconds (default
LONG_COUNT x LONG_EVERY) runs with no long prompts, then a thread submits LONG_COUNT long
prompts (LONG_NEW_TOKENS each), one every LONG_EVERY s, each streamed on a thread of its own.
The long window runs from the first long submission until the last long request finishes;
then the streams are cancelled.

Timing, on the client (time.perf_counter when a delta is taken off the stream): every delta
of a steady stream is an *arrival* of n >= 1 tokens. An arrival interval is the time since
the same stream's previous arrival; it belongs to the window in which its later arrival
falls. The *per-token gap* of the n tokens of an arrival is that interval / n, counted once
per token (so percentiles are over tokens); the raw arrival intervals are reported beside
them. Per window: p50, p90, p99, max of both, p99/p50, and the streams' tokens/s (tokens
arriving in the window / its length). Long requests: TTFT (submission to the first token's
arrival) and total time (submission to the end of the stream), p50 and max.
Issue 36's target: in the long window, per-token p99 <= 2 x p50. A speculation round brings
a stream 1 to k + 1 tokens, so its per-token gaps spread without long prompts too (H200, 8b:
baseline p99/p50 5.2); the arrival intervals show the stalls themselves, and
`mixed_arrival_p99_over_baseline_p50` sets the long window's p99 against the quiet median.

--max-prefill-tokens defaults to 512: the 7,000-token prompt takes 14 scheduler steps, each
one chunk (two 256-token graph replays of the prefill runner) and one decode round; a chunk
then costs about a round of 32 streams on the H200 (8b bf16: ~36k prompt tokens/s measured
by kv-fp8, ~20 ms rounds), and the ~16k prompt tokens/s the steps sustain keep well ahead of
the 7,000 tokens/s arriving, where 256 would leave little margin under LONG_EVERY.
0 or none: whole prompts (the baseline without chunking). The default STREAM_NEW_TOKENS,
8000, keeps max_seq_len within the synthetic pair's 8,192 positions and is ~2x what 32 streams
decode in the run on the H200; streams that end before the last long request are flagged
(`streams_outlasted` false, a warning). Exits 1 when the run fails or a long request does
not finish.

    python examples/gpu/serving_mixed.py --out mixed.json               # 8b bf16, cuda:0
    python examples/gpu/serving_mixed.py --max-prefill-tokens none --out whole.json
    python examples/gpu/serving_mixed.py --synthetic tiny --device cpu --streams 2 \\
        --stream-new-tokens 64 --long-prompt-len 64 --long-count 2 --long-every 0.2 \\
        --max-prefill-tokens 16 --out /tmp/x.json                      # CPU smoke
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import sys
import threading
import time
import traceback

import torch

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from serving_kv import _ms, engine_config, launched

from runtime.bench.report import hardware, now, versions
from runtime.models.loading.synthetic_shapes import SHAPES


def _budget(text: str) -> int | None:
    return None if text.lower() in ("0", "none", "null") else int(text)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--synthetic", default="8b", choices=list(SHAPES))
    p.add_argument("--draft-layers", type=int, default=2)
    p.add_argument("--eps", type=float, default=0.02)
    p.add_argument("--seed", type=int, default=0, help="synthetic weights")
    p.add_argument("--device", default=None, help="default cuda:0 if available, else cpu")
    p.add_argument(
        "--dtype",
        default=None,
        choices=("float32", "float16", "bfloat16"),
        help="default bfloat16 on CUDA, float32 on CPU",
    )
    p.add_argument("--quantization", choices=("fp8",), default=None, help="FP8 weights")
    p.add_argument("--draft-len", default="auto", help="k or auto (default auto)")
    p.add_argument("--synthetic-dir", default=None, help="keep the synthetic pair here")
    p.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false")
    p.add_argument(
        "--max-prefill-tokens",
        type=_budget,
        default=512,
        help="runtime.max_prefill_tokens (default 512; 0 or none: whole prompts)",
    )
    p.add_argument(
        "--max-seq-len",
        type=int,
        default=None,
        help="runtime.max_seq_len (default: the longest request + room)",
    )
    p.add_argument(
        "--kv-cache-tokens",
        type=int,
        default=None,
        help="runtime.kv_cache_tokens (default: what fits after the weights)",
    )
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--stream-prompt-len", type=int, default=128)
    p.add_argument(
        "--stream-new-tokens",
        type=int,
        default=8000,
        help="per steady stream: more than the run needs (they are cancelled)",
    )
    p.add_argument("--long-prompt-len", type=int, default=7000)
    p.add_argument("--long-new-tokens", type=int, default=16)
    p.add_argument("--long-every", type=float, default=1.0, help="seconds between long prompts")
    p.add_argument("--long-count", type=int, default=8)
    p.add_argument(
        "--baseline",
        type=float,
        default=None,
        help="seconds of the window without long prompts (LONG_COUNT x LONG_EVERY)",
    )
    p.add_argument("--out", default=None, help="write the JSON report here")
    args = p.parse_args(argv)
    if args.draft_len != "auto":
        args.draft_len = int(args.draft_len)
    if args.max_prefill_tokens is not None and args.max_prefill_tokens < 2:
        p.error("--max-prefill-tokens: at least 2 (or 0/none: whole prompts)")
    if (
        min(
            args.streams,
            args.long_count,
            args.stream_prompt_len,
            args.long_prompt_len,
            args.stream_new_tokens,
            args.long_new_tokens,
        )
        < 1
        or args.long_every < 0
    ):
        p.error("counts and lengths must be >= 1, --long-every >= 0")
    if args.baseline is None:
        args.baseline = args.long_count * args.long_every
    return args


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between the closest ranks (numpy's default)."""
    xs = sorted(values)
    i = (len(xs) - 1) * q / 100
    lo = math.floor(i)
    return xs[lo] + (xs[min(lo + 1, len(xs) - 1)] - xs[lo]) * (i - lo)


def dist(values: list[float]) -> dict | None:
    if not values:
        return None
    d = {f"p{q}": percentile(values, q) for q in (50, 90, 99)}
    d.update(
        max=max(values),
        mean=statistics.mean(values),
        count=len(values),
        p99_over_p50=d["p99"] / d["p50"] if d["p50"] > 0 else None,
    )
    return d


def window(arrivals: list[list[tuple[float, int]]], lo: float, hi: float) -> dict:
    """The steady streams' arrivals in (lo, hi]: per-token gaps, arrival intervals, tokens/s."""
    per_token, raw, tokens = [], [], 0
    for arr in arrivals:
        for (t0, _), (t1, n) in zip(arr, arr[1:]):
            if lo < t1 <= hi:
                raw.append(t1 - t0)
                per_token += [(t1 - t0) / n] * n
        tokens += sum(n for t, n in arr if lo < t <= hi)
    length = hi - lo
    return {
        "length_s": length,
        "tokens": tokens,
        "tokens_per_s": tokens / length if length > 0 else None,
        "token_gap_s": dist(per_token),
        "arrival_gap_s": dist(raw),
    }


def measure(engine, args, prompts) -> dict:
    """Steady streams, then long prompts beside them (module docstring)."""
    arrivals: list[list[tuple[float, int]]] = [[] for _ in range(args.streams)]
    longs: list[dict] = [
        {"index": i, "tokens": 0, "finished": False} for i in range(args.long_count)
    ]
    long_prompts = prompts(args.long_count, args.long_prompt_len)
    ready, abort = threading.Event(), threading.Event()
    marks: dict[str, float] = {}

    def one_long(rec: dict) -> None:
        rec["submitted"] = time.perf_counter()
        try:
            for delta in engine.stream(
                prompt_token_ids=long_prompts[rec["index"]], max_new_tokens=args.long_new_tokens
            ):
                if delta.token_ids and "first" not in rec:
                    rec["first"] = time.perf_counter()
                rec["tokens"] += len(delta.token_ids)
            rec["finished"] = True
        except Exception as exc:  # noqa: BLE001 - recorded in the report
            rec["error"] = f"{type(exc).__name__}: {exc}"
        rec["end"] = time.perf_counter()

    def driver() -> None:
        ready.wait()
        if abort.is_set():
            return
        start = marks["ready"] + args.baseline
        threads = []
        for rec in longs:
            time.sleep(max(0.0, start + rec["index"] * args.long_every - time.perf_counter()))
            if abort.is_set():
                break
            threads.append(threading.Thread(target=one_long, args=(rec,), daemon=True))
            threads[-1].start()
        for t in threads:
            t.join()

    submitted = time.perf_counter()
    steady = engine.stream(
        prompt_token_ids=prompts(args.streams, args.stream_prompt_len),
        max_new_tokens=args.stream_new_tokens,
    )
    drive = threading.Thread(target=driver, name="long-prompts", daemon=True)
    drive.start()
    try:
        for delta in steady:
            t = time.perf_counter()
            if delta.token_ids:
                arrivals[delta.index].append((t, len(delta.token_ids)))
            if not ready.is_set() and all(arrivals):
                marks["ready"] = t
                ready.set()
            if ready.is_set() and not drive.is_alive():
                break
    except BaseException:
        abort.set()
        ready.set()
        raise
    finally:
        steady.close()  # cancels the streams on the server
    outlasted = ready.is_set() and not drive.is_alive()
    drive.join()
    stats = engine.stats()
    if "ready" not in marks:
        raise RuntimeError("the steady streams ended before each had its first token")
    started = [r for r in longs if "submitted" in r]
    long0 = min((r["submitted"] for r in started), default=marks["ready"])
    end = max((r["end"] for r in started), default=long0)
    base = window(arrivals, marks["ready"], long0)
    mixed = window(arrivals, long0, end)
    for r in longs:
        if "submitted" in r:
            r["submitted_s"] = r["submitted"] - long0
            r["ttft_s"] = r["first"] - r["submitted"] if "first" in r else None
            r["total_s"] = r["end"] - r["submitted"]
        for key in ("submitted", "first", "end"):
            r.pop(key, None)
    ttfts = [r["ttft_s"] for r in longs if r.get("ttft_s") is not None]
    totals = [r["total_s"] for r in longs if "total_s" in r]

    def over_baseline(key: str) -> float | None:  # the long window's p99 / baseline's p50
        b50 = (base[key] or {}).get("p50")
        return mixed[key]["p99"] / b50 if b50 and mixed[key] else None

    return {
        "streams": args.streams,
        "stream_prompt_len": args.stream_prompt_len,
        "long_prompt_len": args.long_prompt_len,
        "long_count": args.long_count,
        "long_every_s": args.long_every,
        "long_new_tokens": args.long_new_tokens,
        "max_prefill_tokens": args.max_prefill_tokens,
        "streams_first_token_s": marks["ready"] - submitted,
        "streams_outlasted": outlasted,
        "stream_tokens": [sum(n for _, n in arr) for arr in arrivals],
        "baseline": base,
        "mixed": mixed,
        "mixed_p99_over_baseline_p50": over_baseline("token_gap_s"),
        "mixed_arrival_p99_over_baseline_p50": over_baseline("arrival_gap_s"),
        "long_requests": longs,
        "long_finished": sum(r["finished"] for r in longs),
        "long_ttft_p50_s": statistics.median(ttfts) if ttfts else None,
        "long_ttft_max_s": max(ttfts, default=None),
        "long_total_p50_s": statistics.median(totals) if totals else None,
        "long_total_max_s": max(totals, default=None),
        "server_stats": stats,
    }


def run(args) -> dict:
    longest = max(
        args.long_prompt_len + args.long_new_tokens, args.stream_prompt_len + args.stream_new_tokens
    )
    prompt_len = max(args.long_prompt_len, args.stream_prompt_len)
    cfg, cleanup = engine_config(
        args, prompt_len, longest - prompt_len, args.streams + args.long_count
    )
    cfg["runtime"]["max_prefill_tokens"] = args.max_prefill_tokens
    try:
        engine, block_size, prompts = launched(cfg)
        with engine:
            # the long prompt's prefill (its chunks' shapes), untimed
            engine.generate(
                prompt_token_ids=prompts(1, args.long_prompt_len),
                max_new_tokens=args.long_new_tokens,
            )
            result = measure(engine, args, prompts)
    finally:
        if cleanup:
            shutil.rmtree(cleanup, ignore_errors=True)
    result.update(
        max_seq_len=cfg["runtime"]["max_seq_len"],
        kv_block_size=block_size,
        max_batch_size=cfg["runtime"]["max_batch_size"],
    )
    return result


def _row(name: str, w: dict, r: dict, note: str, longs: bool) -> str:
    tok, arr = w["token_gap_s"] or {}, w["arrival_gap_s"] or {}
    ratio = " / ".join(
        "-" if d.get("p99_over_p50") is None else f"{d['p99_over_p50']:.2f}" for d in (tok, arr)
    )
    rate = "-" if w["tokens_per_s"] is None else f"{w['tokens_per_s']:.1f}"

    def pair(a: str, b: str) -> str:
        return f"{_ms(r[a])} / {_ms(r[b])}" if longs else "-"

    return (
        f"| {name} | {w['length_s']:.2f} | {rate} | "
        + " | ".join(_ms(tok.get(k)) for k in ("p50", "p90", "p99", "max"))
        + f" | {ratio} | {' / '.join(_ms(arr.get(k)) for k in ('p50', 'p99', 'max'))} | "
        f"{pair('long_ttft_p50_s', 'long_ttft_max_s')} | "
        f"{pair('long_total_p50_s', 'long_total_max_s')} | {note} |"
    )


def table(r: dict) -> str:
    """A row per window: without long prompts, then with them."""
    if "error" in r:
        return f"| measurement | result |\n|---|---|\n| mixed | failed: {r['error'][:160]} |"
    budget = r["max_prefill_tokens"] or "whole prompts"
    return "\n".join(
        [
            "| window | s | stream tokens/s | token gap p50 ms | p90 ms | p99 ms | max ms "
            "| p99/p50 (token / arrival) "
            "| arrival gap p50 / p99 / max ms | long TTFT p50 / max ms | long total p50 / max ms "
            "| note |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|",
            _row(
                "baseline",
                r["baseline"],
                r,
                f"{r['streams']} streams x {r['stream_prompt_len']}"
                f"-token prompts; max_prefill_tokens {budget}",
                False,
            ),
            _row(
                "long prompts",
                r["mixed"],
                r,
                f"{r['long_count']} x {r['long_prompt_len']} + "
                f"{r['long_new_tokens']} every {r['long_every_s']:g} s; {r['long_finished']} "
                "finished" + ("" if r["streams_outlasted"] else "; STREAMS ENDED EARLY"),
                True,
            ),
        ]
    )


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    device = torch.device(args.device or ("cuda:0" if torch.cuda.is_available() else "cpu"))
    try:
        result = run(args)
    except Exception as exc:  # noqa: BLE001 - reported in the table and the JSON
        traceback.print_exc()
        result = {"error": f"{type(exc).__name__}: {exc}"}
    print(table(result))
    if args.out:
        report = {
            "settings": vars(args),
            "date": now(),
            "versions": versions(),
            "hardware": hardware(device.type, device.index),
            "results": result,
        }
        with open(args.out, "w") as fh:
            json.dump(report, fh, indent=2)
        print(f"wrote {args.out}", file=sys.stderr)
    if "error" in result:
        return 1
    if not result["streams_outlasted"]:
        print(
            "serving_mixed: warning: the steady streams ended before the last long request "
            "did; raise --stream-new-tokens",
            file=sys.stderr,
        )
    return 0 if result["long_finished"] == args.long_count else 1


if __name__ == "__main__":
    sys.exit(main())
