"""`tandem bench`: the command line of runtime.bench (see the README's Benchmark section)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings

MODES = ("target", "spec", "spec-sequential", "hf", "hf-compiled", "hf-assisted")


def add_parser(sub) -> argparse.ArgumentParser:
    from runtime.models.loading.synthetic_shapes import SHAPES  # torch-free

    p = sub.add_parser(
        "bench",
        help="benchmark tandem against the target alone and transformers",
        description="Run the modes side by side on the same "
        "seeded random prompts; print a table, optionally write JSON.",
    )
    p.add_argument(
        "config",
        nargs="?",
        help="YAML config whose draft/target to use (instead of --synthetic; default: none)",
    )
    p.add_argument(
        "--synthetic",
        choices=list(SHAPES),
        default=None,
        help="build a random pair of this shape: Llama tiny..70b, or the Qwen3, "
        "OLMo 2, Phi-3 shapes (default tiny without CONFIG)",
    )
    p.add_argument(
        "--draft-layers",
        type=int,
        default=2,
        help="synthetic draft = the target's first K layers (default 2)",
    )
    p.add_argument(
        "--eps",
        type=float,
        default=0.02,
        help="scale of the synthetic target's o_proj/down_proj from layer K on "
        "(OLMo 2: its post-norms)",
    )
    p.add_argument(
        "--device",
        default=None,
        help="synthetic pair's device, e.g. cuda:0 or cpu (default cuda:0 if available)",
    )
    p.add_argument(
        "--target-tp",
        type=int,
        default=1,
        help="synthetic target's tensor-parallel size: devices --device, +1, ...; "
        "the draft runs on --device (default 1)",
    )
    p.add_argument(
        "--batch-sizes",
        default="1",
        type=_int_list,
        help="comma-separated batch sizes to measure, e.g. 1,16",
    )
    p.add_argument("--prompt-len", type=int, default=128, help="tokens per random prompt")
    p.add_argument("--new-tokens", type=int, default=256, help="tokens generated per prompt")
    p.add_argument(
        "--draft-len",
        default=None,
        type=_draft_len,
        help="k (or auto); default: the config's, or 4",
    )
    p.add_argument(
        "--modes",
        default=",".join(MODES),
        type=_modes,
        help=f"comma-separated, from {','.join(MODES)} (default: all)",
    )
    p.add_argument(
        "--dtype",
        choices=("float32", "float16", "bfloat16"),
        default=None,
        help="default: the config's, or bfloat16 on CUDA / float32 on CPU",
    )
    p.add_argument(
        "--quantization",
        choices=("fp8",),
        default=None,
        help="fp8: draft and target weights in FP8 for tandem's modes (float "
        "checkpoints and synthetic pairs are quantized on load); the "
        "transformers modes stay float (default: the config's, or none)",
    )
    p.add_argument("--seed", type=int, default=0, help="prompts (and synthetic weights)")
    p.add_argument("--warmup", type=int, default=1, help="untimed calls per mode and batch")
    p.add_argument("--repeats", type=int, default=1, help="timed calls (median kept)")
    p.add_argument(
        "--synthetic-dir",
        default=None,
        help="keep the synthetic pair here and reuse it (default: a temporary "
        "directory, deleted afterwards)",
    )
    p.add_argument(
        "--compile-on-cpu",
        action="store_true",
        help="run hf-compiled on CPU too (slow to compile; skipped otherwise)",
    )
    p.add_argument(
        "--no-cuda-graphs",
        dest="cuda_graphs",
        action="store_false",
        help="run tandem's decode/verify steps eagerly (runtime.cuda_graphs false)",
    )
    _add_kv_arguments(p)
    p.add_argument(
        "--sampling",
        type=_sampling_json,
        default={},
        help="sampling arguments of the spec modes' requests as JSON, e.g. "
        '\'{"repetition_penalty": 1.2, "logprobs": 5}\' (default: greedy, nothing else); '
        "the other modes refuse any",
    )
    p.add_argument(
        "--verification",
        choices=("token", "block"),
        default=None,
        help="speculation.verification of the spec modes: a sampled window verified token by "
        "token or as a block (docs/sampling.md); sets speculation.acceptance logits "
        "(default: the config's; a synthetic pair's `tokens` acceptance has no such rule)",
    )
    p.add_argument("--out", default=None, help="write the JSON report here (default: none)")
    return p


def _sampling_json(text: str) -> dict:
    """--sampling: a JSON map of sampling arguments (runtime.params), checked."""
    from runtime.params import SamplingParams

    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON map of sampling arguments")
    try:
        SamplingParams.from_kwargs(**value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return value


def _add_kv_arguments(p: argparse.ArgumentParser) -> None:
    """The paged KV cache's settings of the spec modes' Engine (runtime section)."""
    p.add_argument(
        "--prefix-caching",
        action="store_true",
        help="keep runtime.prefix_caching on (default: off here, though on in "
        "the Engine's own default: the warm-up and repeated calls run the "
        "same prompts, so every call after the first would skip its prefill, "
        "and the figures would not compare with runs of older commits)",
    )
    p.add_argument(
        "--max-seq-len",
        type=_positive_int,
        default=None,
        help="runtime.max_seq_len (default: prompt + new tokens + room for a "
        "draft window, or the config's if larger)",
    )
    p.add_argument(
        "--kv-cache-tokens",
        type=_positive_int,
        default=None,
        help="runtime.kv_cache_tokens, the KV pool's size in tokens (default: the "
        "config's, else what fits in GPU memory after the weights; on CPU "
        "max batch size x max_seq_len)",
    )
    p.add_argument(
        "--max-prefill-tokens",
        type=_prefill_budget,
        default=None,
        help="runtime.max_prefill_tokens: an integer >= 2, none (whole prompts) or auto "
        "(default: the config's, or auto: per device type)",
    )
    p.add_argument(
        "--kv-cache-dtype",
        choices=("auto", "fp8"),
        default=None,
        help="runtime.kv_cache_dtype: auto (the activation dtype) or fp8 "
        "(default: the config's, or auto)",
    )


def _positive_int(text: str, what: str = "an integer >= 1", low: int = 1) -> int:
    try:
        value = int(text)
    except ValueError:
        value = low - 1
    if value < low:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
    return value


def _prefill_budget(text: str) -> int | str:
    """--max-prefill-tokens: an integer >= 2, none or auto."""
    if text in ("none", "auto"):
        return text
    return _positive_int(text, "an integer >= 2, none or auto", low=2)


def _int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return values


def _draft_len(text: str):
    return text if text == "auto" else _positive_int(text, "an integer >= 1 or auto")


def _modes(text: str) -> list[str]:
    modes = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        raise argparse.ArgumentTypeError(f"unknown mode(s) {bad}; choose from {','.join(MODES)}")
    return list(dict.fromkeys(modes))


def main(args) -> int:
    if args.config is not None and args.synthetic is not None:
        print("tandem: error: bench: give a CONFIG or --synthetic, not both", file=sys.stderr)
        return 2
    from runtime.bench.report import table, write_json
    from runtime.bench.runner import BenchSettings, failed, run_bench
    from runtime.config import ConfigError

    settings = BenchSettings(
        config=args.config,
        synthetic=None if args.config else (args.synthetic or "tiny"),
        draft_layers=args.draft_layers,
        eps=args.eps,
        device=args.device,
        batch_sizes=args.batch_sizes,
        prompt_len=args.prompt_len,
        new_tokens=args.new_tokens,
        draft_len=args.draft_len,
        modes=args.modes,
        dtype=args.dtype,
        quantization=args.quantization,
        seed=args.seed,
        warmup=args.warmup,
        repeats=args.repeats,
        synthetic_dir=args.synthetic_dir,
        compile_on_cpu=args.compile_on_cpu,
        cuda_graphs=args.cuda_graphs,
        target_tp=args.target_tp,
        prefix_caching=args.prefix_caching,
        max_seq_len=args.max_seq_len,
        kv_cache_tokens=args.kv_cache_tokens,
        kv_cache_dtype=args.kv_cache_dtype,
        max_prefill_tokens=args.max_prefill_tokens,
        sampling=args.sampling,
        verification=args.verification,
    )
    _quiet_libraries()
    try:
        settings.check()
        report = run_bench(settings)
    except (ConfigError, ValueError, FileNotFoundError) as exc:
        print(f"tandem: error: bench: {exc}", file=sys.stderr)
        return 2
    print(table(report["results"]))
    if args.out:
        write_json(args.out, report)
        print(f"wrote {args.out}", file=sys.stderr)
    return 1 if failed(report) else 0


def _quiet_libraries() -> None:
    """The bench prints its table and its own progress. transformers' progress bars
    ("Loading weights", "Writing model shards") and its advice and deprecation notices
    (`torch_dtype` is deprecated, generation_config ...) say nothing about the measurement:
    silenced at their source, here and (through the environment) in the Engine's server and
    workers. With TANDEM_LOG set (debugging) everything is shown."""
    if os.environ.get("TANDEM_LOG"):
        return
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    warnings.filterwarnings("ignore", message=r".*`?torch_dtype`? is deprecated")
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"transformers\.")
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
