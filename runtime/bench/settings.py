"""`tandem bench`'s settings and what they resolve to: the draft/target pair (a config's, or a
synthetic one built here), their devices and dtypes, and the Engine config of the `spec`
modes (runner.py runs them).

The bench times the same seeded prompts in a warm-up call and then `repeats` timed calls, so
with the paged cache's prefix caching on every call after the first would find its whole
prompt cached and skip its prefill: `prefix_caching` is off in the Engine config unless asked
for, which keeps its figures comparable with those of commits before the paged cache.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass, field

import torch

from runtime.bench.modes import MODES
from runtime.config.values import VERIFICATION_RULES
from runtime.models.loading.synthetic_shapes import CONTEXT as SYNTHETIC_CONTEXT

log = logging.getLogger("tandem.bench")
KV_CACHE_DTYPES = ("auto", "fp8")
try:
    from runtime.config.schema import MAX_AUTO_DRAFT_LEN
except ImportError:  # pragma: no cover - older config without draft_len: auto
    MAX_AUTO_DRAFT_LEN = 8


@dataclass
class BenchSettings:
    config: str | None = None
    synthetic: str | None = "tiny"
    draft_layers: int = 2
    eps: float = 0.02
    device: str | None = None  # synthetic only; default cuda:0 if available, else cpu
    batch_sizes: list[int] = field(default_factory=lambda: [1])
    prompt_len: int = 128
    new_tokens: int = 256
    draft_len: int | str | None = None  # None: the config's, or 4 for --synthetic
    modes: list[str] = field(default_factory=lambda: list(MODES))
    dtype: str | None = None  # None: the config's, or bfloat16 on CUDA / float32 on CPU
    quantization: str | None = None  # fp8: draft and target (tandem modes); None: the config's
    seed: int = 0
    warmup: int = 1
    repeats: int = 1
    synthetic_dir: str | None = None  # keep (and reuse) the synthetic pair here
    target_tp: int = 1  # synthetic only: target on this many devices from
    # --device on, the draft on the first of them
    compile_on_cpu: bool = False
    cuda_graphs: bool = True  # tandem's decode/verify steps as CUDA graphs (on CUDA)
    prefix_caching: bool = False  # runtime.prefix_caching of the spec modes' Engine
    max_seq_len: int | None = None  # None: prompt + new tokens + room (or the config's)
    kv_cache_tokens: int | None = None  # None: the config's, or the Engine's default
    kv_cache_dtype: str | None = None  # auto | fp8; None: the config's, or auto
    max_prefill_tokens: int | str | None = None  # N, "none" (whole) or "auto"; None: config's
    sampling: dict = field(default_factory=dict)  # the spec modes' sampling arguments
    # speculation.verification of the spec modes (token | block; sets `acceptance: logits`,
    # the acceptance whose sampled windows it verifies); None: the config's
    verification: str | None = None

    def check(self) -> None:
        if (self.config is None) == (self.synthetic is None):
            raise ValueError("give a CONFIG or --synthetic SHAPE, not both")
        bad = [m for m in self.modes if m not in MODES]
        if bad or not self.modes:
            raise ValueError(f"--modes: unknown {bad}; choose from {','.join(MODES)}")
        if not self.batch_sizes or min(self.batch_sizes) < 1:
            raise ValueError("--batch-sizes: need integers >= 1")
        if self.prompt_len < 1 or self.new_tokens < 1:
            raise ValueError("--prompt-len and --new-tokens must be >= 1")
        if (
            self.draft_len is not None
            and self.draft_len != "auto"
            and (not isinstance(self.draft_len, int) or self.draft_len < 1)
        ):
            raise ValueError("--draft-len: an integer >= 1 or 'auto'")
        if self.warmup < 0 or self.repeats < 1:
            raise ValueError("--warmup must be >= 0 and --repeats >= 1")
        if self.config is not None and (self.device is not None or self.target_tp != 1):
            raise ValueError(
                "--device and --target-tp apply to --synthetic; a CONFIG names its devices"
            )
        if self.target_tp < 1:
            raise ValueError("--target-tp must be >= 1")
        if self.verification is not None and self.verification not in VERIFICATION_RULES:
            raise ValueError(f"--verification: one of {', '.join(VERIFICATION_RULES)}")
        other = [m for m in self.modes if not m.startswith("spec")]
        if self.sampling and other:
            raise ValueError(f"--sampling applies to the spec modes only; drop {other}")
        self.check_device()
        self.check_kv()

    def check_device(self) -> None:
        """--device (and the --target-tp devices after it) exist here: a CUDA device on a
        machine without one is refused before anything is built."""
        if self.device is None:
            return
        try:
            dev = torch.device(self.device)
        except RuntimeError:
            raise ValueError(f"--device: expected cuda:N or cpu, got {self.device!r}") from None
        if dev.type == "cpu":
            return
        if dev.type != "cuda":
            raise ValueError(f"--device: expected cuda:N or cpu, got {self.device!r}")
        count = torch.cuda.device_count()  # 0 without a GPU or a CUDA build of torch
        if count == 0:
            raise ValueError(
                f"--device {self.device}: this machine has no CUDA device (torch "
                f"{torch.__version__} sees none); use --device cpu"
            )
        last = (dev.index or 0) + self.target_tp - 1
        if last >= count:
            tp = f" with --target-tp {self.target_tp}" if self.target_tp > 1 else ""
            raise ValueError(
                f"--device {self.device}{tp} needs cuda:{last}, but this machine has "
                f"{count} CUDA device{'s' * (count != 1)} (cuda:0 to cuda:{count - 1})"
            )

    def check_kv(self) -> None:
        """The KV cache settings (the Engine's config checks the pool against max_seq_len)."""
        if self.max_seq_len is not None and self.max_seq_len < self.prompt_len + self.new_tokens:
            raise ValueError(
                f"--max-seq-len {self.max_seq_len} cannot hold --prompt-len "
                f"{self.prompt_len} + --new-tokens {self.new_tokens}"
            )
        if self.kv_cache_tokens is not None and self.kv_cache_tokens < 1:
            raise ValueError("--kv-cache-tokens must be >= 1")
        if self.kv_cache_dtype is not None and self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"--kv-cache-dtype: one of {', '.join(KV_CACHE_DTYPES)}")


@dataclass
class Setup:
    """What the modes run on, resolved from a config or a synthetic shape."""

    draft: str
    target: str
    draft_device: torch.device
    target_devices: list[torch.device]
    draft_dtype: torch.dtype
    target_dtype: torch.dtype
    engine_config: dict
    draft_len: int | str
    cleanup: str | None = None
    draft_quantization: str | None = None  # tandem's modes only; transformers stays float
    target_quantization: str | None = None

    @property
    def target_device(self) -> torch.device:
        return self.target_devices[0]

    @property
    def target_tp(self) -> int:
        return len(self.target_devices)


def _torch_device(name: str) -> torch.device:
    dev = torch.device(name)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", 0)
    return dev


def _engine_device(dev: torch.device):
    return dev.index if dev.type == "cuda" else f"cpu:{dev.index or 0}"


def _kmax(draft_len) -> int:
    return MAX_AUTO_DRAFT_LEN if draft_len == "auto" else int(draft_len)


def _seq_len(s: BenchSettings, draft_len) -> int:
    """--max-seq-len, else the prompt, the new tokens and room for one draft window."""
    if s.max_seq_len is not None:
        return s.max_seq_len
    return s.prompt_len + s.new_tokens + _kmax(draft_len) + 8


def speculation(s: BenchSettings, draft_len, acceptance: str = "tokens") -> dict:
    """The speculation keys of the spec modes' Engine config: draft_len, and with
    --verification its rule under `logits` acceptance."""
    keys = {"draft_len": draft_len, "acceptance": acceptance}
    if s.verification is not None:
        keys.update(acceptance="logits", verification=s.verification)
    return keys


def kv_runtime(s: BenchSettings) -> dict:
    """The runtime keys of the KV cache that the settings set (prefix_caching always)."""
    keys: dict[str, bool | int | str | None] = {"prefix_caching": s.prefix_caching}
    if s.kv_cache_tokens is not None:
        keys["kv_cache_tokens"] = s.kv_cache_tokens
    if s.kv_cache_dtype is not None:
        keys["kv_cache_dtype"] = s.kv_cache_dtype
    if s.max_prefill_tokens is not None:
        budget = s.max_prefill_tokens
        keys["max_prefill_tokens"] = None if budget == "none" else budget
    return keys


def _pool_tokens(s: BenchSettings, draft_len, max_seq_len: int) -> int:
    """A synthetic run's KV pool unless --kv-cache-tokens says: every row of the largest
    batch at max_seq_len with room for two draft windows (what older commits reserved), not
    the Engine's default of all free memory, which the bench's in-process modes need too."""
    per_request = max_seq_len + 2 * _kmax(draft_len) + 2
    return max(s.batch_sizes) * (-(-per_request // 16) * 16 + 16)


def resolve(s: BenchSettings) -> Setup:
    """The pair, devices, dtypes and Engine config that the settings name."""
    return _resolve_config(s) if s.config is not None else _resolve_synthetic(s)


def _resolve_config(s: BenchSettings) -> Setup:
    from runtime.config import load_config

    assert s.config is not None  # resolve() came here for a config
    cfg = load_config(s.config)
    d = cfg.to_dict()
    if s.dtype:
        d["draft"]["dtype"] = d["target"]["dtype"] = s.dtype
    if s.quantization:
        d["draft"]["quantization"] = d["target"]["quantization"] = s.quantization
    k = s.draft_len if s.draft_len is not None else cfg.speculation.draft_len
    d["speculation"].update(speculation(s, k, cfg.speculation.acceptance))
    rt = d["runtime"]
    rt["max_batch_size"] = max(rt["max_batch_size"], max(s.batch_sizes))
    rt["max_seq_len"] = (
        s.max_seq_len if s.max_seq_len is not None else max(rt["max_seq_len"], _seq_len(s, k))
    )
    rt.update(cuda_graphs=s.cuda_graphs, **kv_runtime(s))
    return Setup(
        cfg.draft.model,
        cfg.target.model,
        cfg.draft.devices[0].torch_device,
        [dev.torch_device for dev in cfg.target.devices],
        getattr(torch, d["draft"]["dtype"]),
        getattr(torch, d["target"]["dtype"]),
        d,
        k,
        draft_quantization=d["draft"].get("quantization"),
        target_quantization=d["target"].get("quantization"),
    )


def _resolve_synthetic(s: BenchSettings) -> Setup:
    assert s.synthetic is not None  # BenchSettings.check: a CONFIG or --synthetic
    device = _torch_device(s.device or ("cuda:0" if torch.cuda.is_available() else "cpu"))
    dtype_name = s.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    k = s.draft_len if s.draft_len is not None else 4
    max_seq_len = _seq_len(s, k)
    # transformers needs weight files; tandem alone draws the weights where it loads them
    draft, target, cleanup = synthetic_pair(
        s.synthetic,
        s.draft_layers,
        s.eps,
        s.seed,
        dtype_name,
        device,
        materialize=any(m.startswith("hf") for m in s.modes),
        synthetic_dir=s.synthetic_dir,
        context=max_seq_len,
    )
    targets = [device] + [
        torch.device(device.type, (device.index or 0) + i) for i in range(1, s.target_tp)
    ]
    quant = {"quantization": s.quantization} if s.quantization else {}
    config = {
        "draft": {
            "model": draft,
            "devices": [_engine_device(device)],
            "dtype": dtype_name,
            **quant,
        },
        "target": {
            "model": target,
            "devices": [_engine_device(d) for d in targets],
            "dtype": dtype_name,
            **quant,
        },
        "speculation": speculation(s, k),
        "runtime": {
            "max_batch_size": max(s.batch_sizes),
            "cuda_graphs": s.cuda_graphs,
            "max_seq_len": max_seq_len,
            "startup_timeout_s": 3600,
            "kv_cache_tokens": _pool_tokens(s, k, max_seq_len),
            **kv_runtime(s),
        },
    }
    dtype = getattr(torch, dtype_name)
    return Setup(
        draft,
        target,
        device,
        targets,
        dtype,
        dtype,
        config,
        k,
        cleanup,
        s.quantization,
        s.quantization,
    )


def synthetic_pair(
    shape: str,
    draft_layers: int,
    eps: float,
    seed: int,
    dtype_name: str,
    device: torch.device,
    materialize: bool = False,
    synthetic_dir: str | None = None,
    context: int | None = None,
) -> tuple[str, str, str | None]:
    """(draft, target, cleanup): a synthetic pair (runtime.models.loading.synthetic), kept
    in and reused from `synthetic_dir` when given, else built in a temporary directory that
    `cleanup` names (delete it when done). The pair's context (max_position_embeddings) is
    raised to `context` where that exceeds its own 8192 (RoPE runs at any position; the
    config checks hold runtime.max_seq_len to the context); such a pair is kept apart."""
    ctx = context if context is not None and context > SYNTHETIC_CONTEXT else None
    cleanup = None
    if synthetic_dir:
        root = (
            f"{synthetic_dir}/{shape}-k{draft_layers}-eps{eps:g}-{dtype_name}-seed{seed}-"
            f"{device.type}{'' if materialize else '-recipe'}{f'-ctx{ctx}' if ctx else ''}"
        )
    else:
        root = cleanup = tempfile.mkdtemp(prefix="tandem-bench-")
    if os.path.isfile(f"{root}/done"):
        log.warning("reusing the synthetic pair in %s", root)
        return f"{root}/draft", f"{root}/target", cleanup
    from runtime.models.loading.synthetic import build_pair

    print(f"bench: building the synthetic {shape} pair in {root}", file=sys.stderr, flush=True)
    try:
        # the random numbers are drawn on the GPU when there is one (much faster)
        draft, target = build_pair(
            root,
            shape,
            draft_layers,
            eps,
            seed,
            getattr(torch, dtype_name),
            gen_device=device,
            materialize=materialize,
        )
        if ctx is not None:
            for path in (draft, target):
                _set_context(path, ctx)
    except BaseException:
        shutil.rmtree(cleanup or root, ignore_errors=True)
        raise
    open(f"{root}/done", "w").close()
    return draft, target, cleanup


def _set_context(model_dir: str, context: int) -> None:
    path = os.path.join(model_dir, "config.json")
    with open(path) as fh:
        config = json.load(fh)
    config["max_position_embeddings"] = context
    with open(path, "w") as fh:
        json.dump(config, fh, indent=2)
