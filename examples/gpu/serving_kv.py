"""The paged KV cache in serving (runtime/serving/block_manager.py, scheduler.py), measured
through `runtime.Engine` on a synthetic pair (greedy, `draft_len: auto`, prefix caching on):

1. `ttft`: the time to first token (the server's, `time_to_first_token_s`) of a prompt of
   PROMPT_LEN + SUFFIX_LEN tokens whose first PROMPT_LEN are cached (a PROMPT_LEN-token prompt
   ran before it), for RUNS different suffixes, against RUNS fresh random prompts of the same
   length (after one such untimed); medians, and the cached prompt tokens each found
   (PROMPT_LEN in whole blocks). One new token each.
2. `serve`: CONCURRENCY requests of PROMPT_LEN random tokens in one generate call,
   NEW_TOKENS each, max_batch_size CONCURRENCY: generated tokens/s of the whole call, the KV
   pool (blocks, tokens), the peak of blocks in use (engine.stats() from a second thread every
   0.2 s while the call runs) and the preemptions.
3. `kvdtype`: the `serve` measurement with runtime.kv_cache_dtype auto, then fp8, the pool
   left at its default (what fits after the weights): tokens/s and the pool each gets.

Each measurement launches its own Engine and closes it; one short generate warms it up
before anything is timed. Writes JSON (--out) and prints a Markdown table.

    python examples/gpu/serving_kv.py ttft --out ttft.json                     # 8b, cuda:0
    python examples/gpu/serving_kv.py serve --concurrency 256 --prompt-len 2000 \\
        --max-seq-len 32768 --out serve.json
    python examples/gpu/serving_kv.py kvdtype --concurrency 8 --prompt-len 8000 --new-tokens 128
    python examples/gpu/serving_kv.py ttft serve kvdtype --synthetic tiny --device cpu \\
        --prompt-len 64 --suffix-len 8 --runs 2 --concurrency 4 --new-tokens 8   # CPU smoke
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import threading
import time
import traceback

import torch

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))
from runtime import Engine
from runtime.bench.report import hardware, now, versions
from runtime.bench.settings import BenchSettings, resolve
from runtime.config import load_config
from runtime.models.loading.synthetic_shapes import SHAPES

EXPERIMENTS = ("ttft", "serve", "kvdtype")
DEFAULTS = {  # per experiment: prompt_len, new_tokens, concurrency (flags override)
    "ttft": (2000, 1, 1),
    "serve": (128, 256, 64),
    "kvdtype": (8000, 128, 8),
}
STATS_PERIOD_S = 0.2


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("experiments", nargs="+", choices=EXPERIMENTS)
    p.add_argument("--synthetic", default="8b", choices=list(SHAPES))
    p.add_argument("--draft-layers", type=int, default=2)
    p.add_argument("--eps", type=float, default=0.02)
    p.add_argument("--seed", type=int, default=0, help="synthetic weights and prompts")
    p.add_argument("--device", default=None, help="default cuda:0 if available, else cpu")
    p.add_argument(
        "--dtype",
        default=None,
        choices=("float32", "float16", "bfloat16"),
        help="default bfloat16 on CUDA, float32 on CPU",
    )
    p.add_argument("--quantization", choices=("fp8",), default=None, help="FP8 weights")
    p.add_argument("--draft-len", default="auto", help="k or auto (default auto)")
    p.add_argument(
        "--synthetic-dir",
        default=None,
        help="keep the synthetic pair here and reuse it (as tandem bench does)",
    )
    p.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false")
    p.add_argument(
        "--prompt-len",
        type=int,
        default=None,
        help="ttft: the cached prefix (2000); serve: 128; kvdtype: 8000",
    )
    p.add_argument("--suffix-len", type=int, default=50, help="ttft: tokens after the prefix")
    p.add_argument("--runs", type=int, default=5, help="ttft: suffixes (and fresh prompts)")
    p.add_argument(
        "--new-tokens", type=int, default=None, help="serve: 256; kvdtype: 128 (ttft: always 1)"
    )
    p.add_argument(
        "--concurrency",
        type=int,
        default=None,
        help="requests in one call, = max_batch_size (serve 64, kvdtype 8)",
    )
    p.add_argument(
        "--max-seq-len",
        type=int,
        default=None,
        help="runtime.max_seq_len (default: prompt + new tokens + room)",
    )
    p.add_argument(
        "--kv-cache-tokens",
        type=int,
        default=None,
        help="runtime.kv_cache_tokens (default: what fits after the weights)",
    )
    p.add_argument("--kv-dtypes", default="auto,fp8", help="kvdtype: the dtypes compared")
    p.add_argument("--out", default=None, help="write the JSON report here")
    args = p.parse_args(argv)
    if args.draft_len != "auto":
        args.draft_len = int(args.draft_len)
    return args


def sizes(args, experiment: str) -> tuple[int, int, int]:
    """(prompt_len, new_tokens, concurrency) of an experiment: the flags, else its defaults."""
    prompt_len, new_tokens, concurrency = DEFAULTS[experiment]
    if experiment == "ttft":
        return args.prompt_len or prompt_len, 1, 1
    return (
        args.prompt_len or prompt_len,
        args.new_tokens or new_tokens,
        args.concurrency or concurrency,
    )


def engine_config(
    args, prompt_len: int, new_tokens: int, batch: int, kv_cache_dtype: str | None = None
) -> tuple[dict, str | None]:
    """The Engine config of one measurement (runtime.bench.settings.resolve: the synthetic
    pair, kept in --synthetic-dir) with prefix caching on, and a directory to delete after."""
    s = BenchSettings(
        synthetic=args.synthetic,
        draft_layers=args.draft_layers,
        eps=args.eps,
        device=args.device,
        batch_sizes=[batch],
        prompt_len=prompt_len,
        new_tokens=new_tokens,
        draft_len=args.draft_len,
        modes=["spec"],
        dtype=args.dtype,
        quantization=args.quantization,
        seed=args.seed,
        synthetic_dir=args.synthetic_dir,
        cuda_graphs=args.cuda_graphs,
        prefix_caching=True,
        max_seq_len=args.max_seq_len,
        kv_cache_tokens=args.kv_cache_tokens,
        kv_cache_dtype=kv_cache_dtype,
    )
    s.check()
    setup = resolve(s)
    if args.kv_cache_tokens is None:  # the Engine's own default (what fits), not the bench's
        setup.engine_config["runtime"].pop("kv_cache_tokens", None)
    return setup.engine_config, setup.cleanup


class Prompts:
    """Seeded random prompts (token ids); every call draws new ones."""

    def __init__(self, vocab: int, seed: int):
        self.vocab = vocab
        self.gen = torch.Generator().manual_seed(seed)

    def __call__(self, n: int, length: int) -> list[list[int]]:
        return torch.randint(0, self.vocab, (n, length), generator=self.gen).tolist()


class PeakBlocks:
    """engine.stats()["kv_blocks_used"] every STATS_PERIOD_S on a thread of its own (a Client
    serves calls from many threads; the server answers stats between rounds): the peak of
    the replies that came while the call ran (none in a call shorter than STATS_PERIOD_S)."""

    def __init__(self, engine):
        self.engine = engine
        self.peak = 0
        self.samples = 0
        self.error: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-peak", daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(STATS_PERIOD_S):
            try:
                used = self.engine.stats(timeout_s=60)["kv_blocks_used"]
            except Exception as exc:  # noqa: BLE001 - reported, the measurement goes on
                self.error = f"{type(exc).__name__}: {exc}"
                return
            if self._stop.is_set():  # answered after the call ended: not a sample of it
                return
            self.peak, self.samples = max(self.peak, used), self.samples + 1

    def __enter__(self) -> PeakBlocks:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def launched(cfg: dict):
    """(engine, its KV block size, a prompt source): an Engine on `cfg`, warmed up with one
    short generate (two prompts of 16 tokens, 8 new tokens each)."""
    block_size = load_config(cfg).runtime.kv_block_size
    engine = Engine.launch(cfg)
    try:
        prompts = Prompts(engine.info()["vocab_size"], 1_000_003)
        engine.generate(
            prompt_token_ids=prompts(min(2, cfg["runtime"]["max_batch_size"]), 16), max_new_tokens=8
        )
    except BaseException:
        engine.close()
        raise
    return engine, block_size, prompts


def ttft(args) -> dict:
    """Cached against uncached TTFT of PROMPT_LEN + SUFFIX_LEN-token prompts."""
    prefix_len = sizes(args, "ttft")[0]
    total = prefix_len + args.suffix_len
    cfg, cleanup = engine_config(args, total, 1, 1)
    try:
        engine, block_size, prompts = launched(cfg)
        with engine:
            # the first prefill of this length, untimed (the short warm-up's is smaller)
            engine.generate(prompt_token_ids=prompts(1, total), max_new_tokens=1)
            prefix = prompts(1, prefix_len)[0]
            engine.generate(prompt_token_ids=prefix, max_new_tokens=1)
            cached = [
                engine.generate(prompt_token_ids=prefix + suffix, max_new_tokens=1)
                for suffix in prompts(args.runs, args.suffix_len)
            ]
            fresh = [
                engine.generate(prompt_token_ids=p, max_new_tokens=1)
                for p in prompts(args.runs, total)
            ]
            stats = engine.stats()
    finally:
        if cleanup:
            shutil.rmtree(cleanup, ignore_errors=True)
    hit, miss = ([o.stats["time_to_first_token_s"] for o in outs] for outs in (cached, fresh))
    return {
        "prompt_tokens": total,
        "cached_prefix_tokens": prefix_len,
        "expected_cached_tokens": prefix_len // block_size * block_size,
        "cached_prompt_tokens": [o.stats["cached_prompt_tokens"] for o in cached],
        "uncached_prompt_tokens": [o.stats["cached_prompt_tokens"] for o in fresh],
        "ttft_cached_s": hit,
        "ttft_uncached_s": miss,
        "ttft_cached_median_s": statistics.median(hit),
        "ttft_uncached_median_s": statistics.median(miss),
        "speedup": statistics.median(miss) / statistics.median(hit),
        "kv_block_size": block_size,
        "server_stats": stats,
    }


def serve(args, kv_cache_dtype: str | None = None, experiment: str = "serve") -> dict:
    """CONCURRENCY requests in one call: tokens/s, the pool, its peak use, preemptions."""
    prompt_len, new_tokens, n = sizes(args, experiment)
    cfg, cleanup = engine_config(args, prompt_len, new_tokens, n, kv_cache_dtype)
    try:
        engine, block_size, prompts = launched(cfg)
        with engine:
            batch = prompts(n, prompt_len)
            before = engine.stats()
            with PeakBlocks(engine) as peak:
                start = time.perf_counter()
                outs = engine.generate(prompt_token_ids=batch, max_new_tokens=new_tokens)
                wall = time.perf_counter() - start
            stats = engine.stats()
    finally:
        if cleanup:
            shutil.rmtree(cleanup, ignore_errors=True)
    tokens = sum(len(o.token_ids) for o in outs)
    return {
        "concurrency": n,
        "prompt_len": prompt_len,
        "new_tokens": new_tokens,
        "max_seq_len": cfg["runtime"]["max_seq_len"],
        "kv_cache_dtype": kv_cache_dtype or "auto",
        "generated_tokens": tokens,
        "wall_s": wall,
        "tokens_per_s": tokens / wall,
        "ttft_median_s": statistics.median(o.stats["time_to_first_token_s"] for o in outs),
        "acceptance_rate": statistics.mean(o.stats["acceptance_rate"] for o in outs),
        "kv_block_size": block_size,
        "kv_blocks_total": stats["kv_blocks_total"],
        "kv_pool_tokens": stats["kv_blocks_total"] * block_size,
        "peak_kv_blocks_used": peak.peak if peak.samples else None,
        "peak_samples": peak.samples,
        "peak_error": peak.error,
        "num_preemptions": stats["num_preemptions"] - before["num_preemptions"],
        "request_preemptions": sum(o.stats["preemptions"] for o in outs),
        "server_stats": stats,
    }


def kvdtype(args) -> dict:
    """`serve` at each of --kv-dtypes (a failure is recorded, the next one still runs)."""
    results = {}
    for dtype in [d.strip() for d in args.kv_dtypes.split(",") if d.strip()]:
        try:
            results[dtype] = serve(args, dtype, "kvdtype")
        except Exception as exc:  # noqa: BLE001 - reported in the table
            traceback.print_exc()
            results[dtype] = {"error": f"{type(exc).__name__}: {exc}"}
    return results


def _span(values: list[int]) -> str:
    return str(min(values)) if min(values) == max(values) else f"{min(values)}-{max(values)}"


def _ms(seconds) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.1f}"


def _serve_row(name: str, r: dict) -> str:
    if "error" in r:
        return f"| {name} | failed | | | | | | {r['error'][:120]} |"
    peak = "-" if r["peak_kv_blocks_used"] is None else r["peak_kv_blocks_used"]
    return (
        f"| {name} | {r['tokens_per_s']:.1f} | {_ms(r['ttft_median_s'])} | - | "
        f"{r['kv_pool_tokens']} | {peak} / {r['kv_blocks_total']} | "
        f"{r['num_preemptions']} | {r['concurrency']} x {r['prompt_len']} + "
        f"{r['new_tokens']}, max_seq_len {r['max_seq_len']} |"
    )


def table(results: dict) -> str:
    """One Markdown row per measurement."""
    lines = [
        "| measurement | tokens/s | TTFT ms (median) | cached prompt tokens | "
        "KV pool tokens | peak KV blocks used / total | preemptions | note |",
        "|---|---|---|---|---|---|---|---|",
    ]
    if "ttft" in results:
        r = results["ttft"]
        if "error" in r:
            lines.append(f"| ttft | failed | | | | | | {r['error'][:120]} |")
        else:
            lines += [
                f"| ttft cached | - | {_ms(r['ttft_cached_median_s'])} | "
                f"{_span(r['cached_prompt_tokens'])} | | | | "
                f"{r['cached_prefix_tokens']} of {r['prompt_tokens']} cached "
                f"(expected {r['expected_cached_tokens']}); {r['speedup']:.2f}x |",
                f"| ttft uncached | - | {_ms(r['ttft_uncached_median_s'])} | "
                f"{_span(r['uncached_prompt_tokens'])} | | | | "
                f"{r['prompt_tokens']} fresh tokens |",
            ]
    for name, r in results.items():
        if name.startswith("serve"):
            lines.append(_serve_row(name, r))
        elif name == "kvdtype":
            lines += [_serve_row(f"kvdtype {dtype}", v) for dtype, v in r.items()]
    return "\n".join(lines)


def run(args) -> dict:
    """Every experiment asked for; one that fails is recorded and the next one still runs."""
    results = {}
    for experiment in args.experiments:
        if experiment == "serve":
            prompt_len, _, n = sizes(args, "serve")
            name = f"serve-{n}-{prompt_len}"
        else:
            name = experiment
        print(f"serving_kv: {name}", file=sys.stderr, flush=True)
        try:
            results[name] = {"ttft": ttft, "serve": serve, "kvdtype": kvdtype}[experiment](args)
        except Exception as exc:  # noqa: BLE001 - reported in the table and the JSON
            traceback.print_exc()
            results[name] = {"error": f"{type(exc).__name__}: {exc}"}
    return results


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    device = torch.device(args.device or ("cuda:0" if torch.cuda.is_available() else "cpu"))
    results = run(args)
    print(table(results))
    if args.out:
        report = {
            "settings": vars(args),
            "date": now(),
            "versions": versions(),
            "hardware": hardware(device.type, device.index),
            "results": results,
        }
        with open(args.out, "w") as fh:
            json.dump(report, fh, indent=2)
        print(f"wrote {args.out}", file=sys.stderr)
    failed = any(
        "error" in r or any(isinstance(v, dict) and "error" in v for v in r.values())
        for r in results.values()
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
