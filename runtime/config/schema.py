"""The tandem config's schema: frozen dataclasses, and the parsing of a raw mapping into them.

Every problem raises `ConfigError`, whose message starts with the dotted key at fault
(`"target.devices: device cpu:0 is listed twice"`). runtime.config.load.load_config is the
door in: it parses, then runs runtime.config.checks.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any, ClassVar

from parallel.devices import Device
from parallel.topology import Topology, build_topology
from runtime.config import values as check
from runtime.config.nodes import resolve_config_nodes
from runtime.config.paths import (
    default_model_path,
    resolve_path,
)
from runtime.config.values import ACCEPTANCE_MODES, DTYPES, VERIFICATION_RULES
from runtime.errors import ConfigError

if TYPE_CHECKING:  # torch is imported lazily: reading a config should stay cheap
    import torch

__all__ = [
    "ConfigError",
    "Device",
    "ModelConfig",
    "SpeculationConfig",
    "RuntimeConfig",
    "ServerConfig",
    "TandemConfig",
    "parse_config",
    "parse_device",
    "default_config",
    "default_model_path",
]


MAX_AUTO_DRAFT_LEN = 8
# runtime.max_prefill_tokens: auto, by the target's device type (docs/configuration.md,
# "Chunked prefill", has the measurements): a CPU step of 128 prompt tokens is ~2.5 s of a
# 1B float32 target on two cores; on a GPU a chunk under 2,048 tokens costs a lone prompt
# time to first token (each chunk reads the weights again) for steadier streams
PREFILL_BUDGETS = {"cpu": 128, "cuda": 2048}


def _checked(default: Any, check: Callable[[Any, str], Any]) -> Any:
    return field(default=default, metadata={"check": check})


class _Checked:
    """Mixin for section dataclasses: validate each field as `<SECTION>.<field>` on creation."""

    SECTION: ClassVar[str]

    def __post_init__(self) -> None:
        for f in fields(self):  # type: ignore[arg-type]
            check = f.metadata.get("check")
            if check is not None:
                value = check(getattr(self, f.name), f"{self.SECTION}.{f.name}")
                object.__setattr__(self, f.name, value)


@dataclass(frozen=True)
class ModelConfig:
    # absolute path: HF checkpoint dir or .gguf file (an HF id in the config is resolved to
    # its snapshot dir)
    model: str
    devices: tuple[Device, ...]
    dtype: str = "bfloat16"  # float32 | float16 | bfloat16
    kv_cache_memory: float | None = None  # share of device memory the KV cache may take
    quantization: str | None = None  # None: as stored | "fp8": quantize on load

    def __post_init__(self) -> None:
        object.__setattr__(self, "devices", tuple(self.devices))

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, self.dtype)

    @property
    def tp_size(self) -> int:
        return len(self.devices)

    def to_dict(self) -> dict:
        """Every key of a model section (_MODEL_KEYS), None ones included: --print-config
        shows the whole schema."""
        return {
            "model": self.model,
            "devices": [str(d) for d in self.devices],
            "dtype": self.dtype,
            "kv_cache_memory": self.kv_cache_memory,
            "quantization": self.quantization,
        }


@dataclass(frozen=True)
class SpeculationConfig(_Checked):
    SECTION: ClassVar[str] = "speculation"
    draft_len: int | str = _checked(4, check.draft_len_value)  # or "auto": chosen every round
    acceptance: str = _checked("tokens", check.choice(*ACCEPTANCE_MODES))
    # draft the next window while the target verifies (runtime.worker.overlap): auto = when
    # draft and target share no device
    overlap: bool | str = _checked("auto", check.overlap_mode)
    # structured outputs: the draft proposes under the grammar's masks (false: freely; the
    # target's verification enforces the grammar either way: docs/sampling.md)
    mask_draft: bool = _checked(True, check.boolean)
    # how `logits` acceptance verifies a sampled window: as a block (Sun et al. 2025; never
    # fewer tokens a round in expectation), or token by token (Leviathan et al.); the default
    # is measured: docs/sampling.md, "Token or block: measured on the CPU"
    verification: str = _checked("block", check.choice(*VERIFICATION_RULES))

    @property
    def fixed_draft_len(self) -> int | None:
        """draft_len, or None for "auto"."""
        return self.draft_len if isinstance(self.draft_len, int) else None

    @property
    def max_draft_len(self) -> int:
        """The most draft tokens a round may propose (KV caches leave room for them)."""
        return self.draft_len if isinstance(self.draft_len, int) else MAX_AUTO_DRAFT_LEN


@dataclass(frozen=True)
class RuntimeConfig(_Checked):
    SECTION: ClassVar[str] = "runtime"
    max_batch_size: int = _checked(8, check.int_at_least(1))
    max_seq_len: int = _checked(4096, check.int_at_least(2))
    kv_block_size: int = _checked(16, check.int_at_least(1))  # tokens per KV block
    kv_cache_tokens: int | None = _checked(None, check.optional_int_at_least(1))  # the pool's size
    kv_cache_dtype: str = _checked("auto", check.choice("auto", "fp8"))  # fp8: e4m3 with scales
    prefix_caching: bool = _checked(True, check.boolean)  # reuse KV blocks of prefixes seen
    # prompt tokens one step may prefill (chunked prefill: a step stays bounded, decoding
    # streams get a round between chunks; null: whole prompts; auto: PREFILL_BUDGETS by the
    # target's device type; docs/configuration.md, "Chunked prefill")
    max_prefill_tokens: int | str | None = _checked("auto", check.prefill_budget)
    startup_timeout_s: float = _checked(300.0, check.positive_float)
    step_timeout_s: float = _checked(120.0, check.positive_float)
    heartbeat_s: float = _checked(1.0, check.positive_float)
    cuda_graphs: bool = _checked(True, check.boolean)
    draft_ahead: bool = _checked(True, check.boolean)  # the next round's work, done ahead
    # intra-op threads of each CPU worker (null: auto, runtime.worker.process._cpu_threads)
    cpu_threads: int | None = _checked(None, check.optional_int_at_least(1))
    download: bool = _checked(False, check.boolean)  # may an uncached HF id be downloaded


@dataclass(frozen=True)
class ServerConfig(_Checked):
    SECTION: ClassVar[str] = "server"
    address: str = _checked("tcp://127.0.0.1:5555", check.zmq_address)
    auth_key_file: str | None = _checked(None, check.optional_str)  # required beyond loopback
    # the HTTP API's bearer key file (runtime.api.http.access); auth_key_file signs ZeroMQ's
    api_key_file: str | None = _checked(None, check.optional_str)
    # a client with requests in flight that sends nothing (it pings every second) for this
    # long is judged gone: its requests are cancelled (runtime.serving.server)
    client_timeout_s: float = _checked(10.0, check.positive_float)
    # SIGTERM drains: new requests are refused, those in flight get this long to finish
    # (runtime.serving.server); 0: SIGTERM stops at once, as SIGINT does. 20 s leaves 10 s
    # of Kubernetes' default 30 s grace period for the rest of the shutdown (docs/serving.md)
    shutdown_timeout_s: float = _checked(20.0, check.seconds_at_least_0)
    max_logprobs: int = _checked(20, check.int_at_least(0))  # logprobs, prompt_logprobs cap
    max_n: int = _checked(16, check.int_at_least(1))  # samples (n) one request may ask for
    # the HTTP front's tool-call format (runtime.api.tools.parsers); null: the chat template's
    tool_parser: str | None = _checked(None, check.tool_parser)


@dataclass(frozen=True)
class TandemConfig:
    draft: ModelConfig
    target: ModelConfig
    tokenizer: str | None = None  # absolute path, or None = the target's
    speculation: SpeculationConfig = field(default_factory=SpeculationConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    server: ServerConfig = field(default_factory=ServerConfig)

    def __post_init__(self) -> None:
        draft, target = resolve_config_nodes(self.draft.devices, self.target.devices)
        if (draft, target) != (self.draft.devices, self.target.devices):  # `1` = `n0:1`
            object.__setattr__(self, "draft", replace(self.draft, devices=draft))
            object.__setattr__(self, "target", replace(self.target, devices=target))
        shared = sorted(map(str, set(self.draft.devices) & set(self.target.devices)))
        if self.speculation.overlap is True and shared:
            raise ConfigError(
                "speculation.overlap",
                f"true needs disjoint device lists, but "
                f"draft and target share {', '.join(shared)}; use auto or "
                f"false, or give the draft its own devices",
            )
        self.check_kv_pool()

    @property
    def prefill_budget(self) -> int | None:
        """runtime.max_prefill_tokens resolved: `auto` by the target's device type."""
        budget = self.runtime.max_prefill_tokens
        if budget != "auto":
            return budget  # type: ignore[return-value]  # an int >= 2 or None, checked
        return PREFILL_BUDGETS[self.target.devices[0].kind]

    @property
    def overlapped(self) -> bool:
        """Whether rounds overlap drafting and verification (speculation.overlap resolved)."""
        if self.speculation.overlap == "auto":
            return not set(self.draft.devices) & set(self.target.devices)
        return self.speculation.overlap is True

    def topology(self) -> Topology:
        """Who is who: one worker rank per distinct device (parallel.topology)."""
        return build_topology(self.draft.devices, self.target.devices)

    @property
    def kv_seq_len(self) -> int:
        """Positions one request's block table addresses: max_seq_len, and room past it for
        one window of drafts (two when the next is drafted during verification: overlap)
        and the pending tokens. A KV pool must hold at least this much."""
        windows = 2 if self.overlapped else 1
        return self.runtime.max_seq_len + windows * self.speculation.max_draft_len + 2

    def check_kv_pool(self) -> None:
        """runtime.kv_cache_tokens, when set, holds one request of max_seq_len."""
        rt = self.runtime
        if rt.kv_cache_tokens is None:
            return
        need = -(-self.kv_seq_len // rt.kv_block_size) * rt.kv_block_size
        if rt.kv_cache_tokens < need:
            raise ConfigError(
                "runtime.kv_cache_tokens",
                f"{rt.kv_cache_tokens} tokens cannot hold one request of "
                f"runtime.max_seq_len {rt.max_seq_len}: it needs {need} (whole "
                f"blocks of runtime.kv_block_size {rt.kv_block_size}, with room "
                f"for draft windows); raise runtime.kv_cache_tokens or lower "
                f"runtime.max_seq_len",
            )

    @property
    def tokenizer_path(self) -> str:
        return self.tokenizer if self.tokenizer is not None else self.target.model

    def to_dict(self) -> dict:
        """Plain str/int/float/list/None data; load_config(to_dict(), check_*=False) == self."""

        def section(obj: Any) -> dict:
            return {f.name: getattr(obj, f.name) for f in fields(obj)}

        return {
            "draft": self.draft.to_dict(),
            "target": self.target.to_dict(),
            "tokenizer": self.tokenizer,
            "speculation": section(self.speculation),
            "runtime": section(self.runtime),
            "server": section(self.server),
        }


_TOP_KEYS = ("draft", "target", "tokenizer", "speculation", "runtime", "server")
_MODEL_KEYS = ("model", "devices", "dtype", "kv_cache_memory", "quantization")


def _check_keys(raw: dict, prefix: str, allowed: tuple[str, ...]) -> None:
    for name in raw:
        if name not in allowed:
            close = difflib.get_close_matches(str(name), allowed, n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise ConfigError(
                f"{prefix}{name}", f"unknown key{hint}; allowed keys here: {', '.join(allowed)}"
            )


def _mapping(value: Any, key: str) -> dict:
    if not isinstance(value, dict):
        raise ConfigError(key, f"must be a mapping, got {check.describe(value)}")
    return value


def parse_device(value: Any, key: str) -> Device:
    """Device.parse, its complaint as a ConfigError naming `key`."""
    try:
        return Device.parse(value)
    except ValueError as exc:
        raise ConfigError(key, str(exc)) from None


def _parse_devices(value: Any, key: str) -> tuple[Device, ...]:
    if not isinstance(value, (list, tuple)):
        raise ConfigError(
            key, f"must be a list like [0, 1], [cpu:0] or [n1:0], got {check.describe(value)}"
        )
    if not value:
        raise ConfigError(key, "must list at least one device")
    devices: list[Device] = []
    for item in value:
        device = parse_device(item, key)
        if device in devices:
            raise ConfigError(key, f"device {device} is listed twice")
        devices.append(device)
    return tuple(devices)


def _parse_model(value: Any, key: str, base: str, download: bool | None) -> ModelConfig:
    raw = _mapping(value, key)
    _check_keys(raw, f"{key}.", _MODEL_KEYS)
    for required in ("model", "devices"):
        if required not in raw:
            raise ConfigError(f"{key}.{required}", "required key is missing")
    dtype = check.choice(*DTYPES)(raw.get("dtype", "bfloat16"), f"{key}.dtype")
    return ModelConfig(
        model=resolve_path(raw["model"], f"{key}.model", base, download),
        devices=_parse_devices(raw["devices"], f"{key}.devices"),
        dtype=dtype,
        kv_cache_memory=check.fraction(raw.get("kv_cache_memory"), f"{key}.kv_cache_memory"),
        quantization=check.quantization_mode(raw.get("quantization"), f"{key}.quantization"),
    )


def _parse_section(
    value: Any, cls: type[SpeculationConfig] | type[RuntimeConfig] | type[ServerConfig]
) -> Any:
    if value is None:  # `speculation:` with nothing under it
        return cls()
    raw = _mapping(value, cls.SECTION)
    _check_keys(raw, f"{cls.SECTION}.", tuple(f.name for f in fields(cls)))
    return cls(**raw)


def parse_config(raw: dict, base: str, resolve_ids: bool) -> TandemConfig:
    """resolve_ids: look Hugging Face ids up in the local cache (see _resolve_path)."""
    _check_keys(raw, "", _TOP_KEYS)
    for required in ("draft", "target"):
        if raw.get(required) is None:
            raise ConfigError(required, "required section is missing")
    runtime = _parse_section(raw.get("runtime"), RuntimeConfig)  # runtime.download first
    download = runtime.download if resolve_ids else None
    tokenizer = raw.get("tokenizer")
    if tokenizer is not None:
        tokenizer = resolve_path(tokenizer, "tokenizer", base, download)
    return TandemConfig(
        draft=_parse_model(raw["draft"], "draft", base, download),
        target=_parse_model(raw["target"], "target", base, download),
        tokenizer=tokenizer,
        speculation=_parse_section(raw.get("speculation"), SpeculationConfig),
        runtime=runtime,
        server=_parse_section(raw.get("server"), ServerConfig),
    )


def default_config() -> TandemConfig:
    """The built-in CPU demo: SmolLM2-135M-Instruct (GGUF) as both draft and target."""
    model = ModelConfig(model=default_model_path(), devices=(Device("cpu", 0),), dtype="float32")
    return TandemConfig(
        draft=model,
        target=model,
        tokenizer=None,
        speculation=SpeculationConfig(draft_len=4, acceptance="tokens"),
        runtime=RuntimeConfig(max_batch_size=8, max_seq_len=2048),
        server=ServerConfig(),
    )
