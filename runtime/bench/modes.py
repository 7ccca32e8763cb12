"""The benchmark's modes. Each one generates greedily from the same prompts and reports the
generated tokens and the wall time of the whole call (prefill and first token included).

- `target`  (TandemTarget): the target alone through tandem's own model code, in this process:
  runtime.models.load_model, allocate_cache, the prompt, then one step per token with argmax
  on the device, through the workers' StepRunner (CUDA graphs on CUDA, no host sync). No
  orchestrator, no worker, no draft: the decode speed of tandem's model code, which a
  speculation round builds on. With --quantization fp8 it (and `spec`) runs FP8 weights;
  the transformers modes keep the float weights (their rows say so).
- `spec`    (TandemSpec): the tandem Engine (orchestrator + workers, spawn launch) running
  draft-target speculative decoding on the configured devices.
- `hf`, `hf-compiled` (HFGenerate): transformers `generate` of the target, eager with its
  dynamic cache, or with a static cache and transformers' automatic torch.compile of the
  decode step (CompileConfig mode "reduce-overhead" on CUDA, i.e. CUDA graphs).
- `hf-assisted` (HFAssisted): transformers assisted generation with the same draft,
  num_assistant_tokens = k, schedule "constant", no confidence early stop.
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from runtime.bench.metrics import DeviceClock, sync

MODES = ("target", "spec", "spec-sequential", "hf", "hf-compiled", "hf-assisted")


class Skipped(Exception):
    """This mode cannot run in this setting; str(exc) says why."""


@dataclass
class Outcome:
    tokens: int  # generated tokens, all rows
    wall_s: float  # the whole generate call
    acceptance_rate: float | None = None  # accepted draft tokens / proposed draft tokens
    mean_accepted_tokens: float | None = None  # tokens committed per round (incl. the target's)
    alpha: float | None = None  # per-token acceptance probability (see metrics)
    rounds: int | None = None
    extra: dict = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s > 0 else 0.0


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


class worker_backends:
    """The attention backend settings of a tandem worker (runtime/worker.py), for running our
    model code in this process: cuDNN attention off on CUDA (it rebuilds a plan for every new
    KV length). Restored on exit, so the transformers modes get torch's defaults."""

    def __enter__(self):
        self.cudnn = torch.backends.cuda.cudnn_sdp_enabled()
        torch.backends.cuda.enable_cudnn_sdp(False)
        return self

    def __exit__(self, *exc):
        torch.backends.cuda.enable_cudnn_sdp(self.cudnn)


class TandemTarget:
    """The target alone on tandem's model code, in this process, greedy. With a TPInfo of size
    > 1 this process is one rank of a tensor-parallel target (every rank runs the same calls;
    see runtime/bench/tp_target.py) and the argmax runs over the vocab-parallel logits, as the
    workers verify."""

    name = "target"

    def __init__(
        self,
        path: str,
        dtype: torch.dtype,
        device: torch.device,
        max_batch: int,
        max_seq_len: int,
        max_step_len: int = 1,
        cuda_graphs: bool = True,
        tp=None,
        quantization: str | None = None,
    ):
        from runtime.models import load_model
        from runtime.models.runners.step_runner import StepRunner

        self.device = device
        parallel = tp is not None and tp.enabled
        self.model = load_model(
            path, dtype, device, tp, gather_logits=not parallel, quantization=quantization
        )
        self.model.allocate_cache(max_batch, max_seq_len)
        self.runner = StepRunner(self.model, device, max_batch, max_step_len, cuda_graphs)
        self.argmax = lambda logits: logits.argmax(-1)
        if parallel:
            from parallel.vocab import VocabParallel

            self.argmax = VocabParallel.of(self.model, tp.group).argmax

    @torch.no_grad()  # not inference_mode: the step buffers are reused outside it
    def run(self, prompts: list[list[int]], new_tokens: int) -> Outcome:
        dev = self.device
        bsz, length = len(prompts), len(prompts[0])
        sync(dev)
        start = time.perf_counter()
        first = DeviceClock(dev)
        first.start()
        ids = torch.tensor(prompts, dtype=torch.long, device=dev)
        slots = list(range(bsz))
        token = self.argmax(self.runner.prefill_last(ids, slots, [0] * bsz, [length] * bsz))
        first.mark()  # the first token, without a sync
        out = [token]
        for i in range(new_tokens - 1):  # decode steps: CUDA graphs, no host sync
            logits = self.runner.run(token[:, None], slots, [length + i] * bsz, [1] * bsz)
            token = self.argmax(logits[:, -1])
            out.append(token)
        generated = torch.stack(out, 1).tolist()  # the host sync that ends the call
        wall = time.perf_counter() - start
        return Outcome(
            tokens=sum(len(r) for r in generated),
            wall_s=wall,
            extra={"token_ids": generated, "time_to_first_token_s": [first.seconds()] * bsz},
        )

    def close(self) -> None:
        del self.model
        free_memory()


def timed(mode, prompts: list[list[int]], new_tokens: int, warmup: int, repeats: int) -> Outcome:
    """`warmup` untimed calls, then the median of `repeats` timed ones."""
    return timed_side_by_side({"mode": mode}, prompts, new_tokens, warmup, repeats)["mode"]


def timed_side_by_side(
    modes: dict, prompts: list[list[int]], new_tokens: int, warmup: int, repeats: int
) -> dict[str, Outcome]:
    """`timed` for modes loaded at once: each gets `warmup` untimed calls, then the timed
    calls take turns (A B, B A, A B, ...), so that a drifting host or a busy neighbour weighs
    on each alike; per mode the median of its `repeats` calls, and in its extra the
    tokens/s of every timed call in order (`call_tokens_per_s`)."""
    for mode in modes.values():
        for _ in range(warmup):
            mode.run(prompts, new_tokens)
    runs: dict[str, list[Outcome]] = {name: [] for name in modes}
    for i in range(repeats):
        for name in list(modes) if i % 2 == 0 else list(modes)[::-1]:
            runs[name].append(modes[name].run(prompts, new_tokens))
    medians = {}
    for name, outs in runs.items():
        median = sorted(outs, key=lambda o: o.wall_s)[(len(outs) - 1) // 2]
        median.extra["call_tokens_per_s"] = [o.tokens_per_s for o in outs]
        medians[name] = median
    return medians


class TandemSpec:
    """tandem's Engine: speculative decoding with draft and target on the configured devices.
    `overlap=False` (the `spec-sequential` mode) runs the same with speculation.overlap off,
    for side-by-side runs on disjoint devices; where the config does not overlap anyway it is
    skipped."""

    name = "spec"

    def __init__(self, config: dict, overlap: bool | None = None):
        from runtime.api.engine import Engine
        from runtime.config import load_config

        self.draft_len = config["speculation"]["draft_len"]
        if overlap is not None:
            if not load_config(config, check_files=False, check_devices=False).overlapped:
                raise Skipped("draft and target share devices: spec is sequential already")
            config = {**config, "speculation": {**config["speculation"], "overlap": overlap}}
        self.engine = Engine.launch(config)

    def run(self, prompts: list[list[int]], new_tokens: int) -> Outcome:
        start = time.perf_counter()
        outs = self.engine.generate(
            prompt_token_ids=[list(p) for p in prompts], max_new_tokens=new_tokens, temperature=0.0
        )
        wall = time.perf_counter() - start
        outs = outs if isinstance(outs, list) else [outs]
        rounds = sum(o.stats.get("rounds", 0) for o in outs)
        tokens = sum(len(o.token_ids) for o in outs)
        kept = tested = drafting = 0
        proposed_weighted = 0.0
        for o in outs:  # rounds that drafted (a target-only round tests no draft token)
            r = o.stats.get("rounds", 0) - o.stats.get("target_only_rounds", 0)
            kept += sum(o.stats.get("accepted_per_position", ()))
            tested += o.stats.get("tested_draft_tokens", 0)
            proposed_weighted += o.stats.get("acceptance_rate", 0.0) * r
            drafting += r
        alpha = kept / tested if tested else None  # kept / tested draft tokens, exactly
        mat = sum(o.stats.get("mean_accepted_tokens", 0.0) * o.stats.get("rounds", 0) for o in outs)
        return Outcome(
            tokens=tokens,
            wall_s=wall,
            acceptance_rate=proposed_weighted / drafting if drafting else None,
            mean_accepted_tokens=mat / rounds if rounds else None,
            alpha=alpha,
            rounds=rounds,
            extra={
                "token_ids": [list(o.token_ids) for o in outs],
                "overlap_share": sum(o.stats.get("overlapped_rounds", 0) for o in outs) / rounds
                if rounds
                else 0.0,
                "server_tokens_per_s": [o.stats.get("tokens_per_s") for o in outs],
                "time_to_first_token_s": [o.stats.get("time_to_first_token_s") for o in outs],
            },
        )

    def server_stats(self) -> dict:
        return self.engine.stats()

    def close(self) -> None:
        self.engine.close()


def load_hf(path: str, dtype: torch.dtype, device: torch.device):
    """transformers AutoModelForCausalLM of an HF checkpoint dir or .gguf file, greedy, with
    EOS switched off so that every mode generates exactly new_tokens tokens."""
    from transformers import AutoModelForCausalLM

    p = Path(path)
    kwargs = {"gguf_file": p.name} if p.is_file() else {}
    directory = str(p.parent if p.is_file() else p)
    try:  # straight onto the GPU where transformers can
        model = AutoModelForCausalLM.from_pretrained(
            directory,
            dtype=dtype,
            **kwargs,
            **({"device_map": str(device)} if device.type == "cuda" else {}),
        )
    except (ImportError, ValueError):
        model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype, **kwargs)
    # transformers wraps PreTrainedModel.to in a decorator whose stub takes no device
    model = model.to(device).eval()  # type: ignore[arg-type]
    gen = model.generation_config
    pad = gen.pad_token_id if gen.pad_token_id is not None else 0
    if isinstance(gen.eos_token_id, int) and gen.pad_token_id is None:
        pad = gen.eos_token_id
    gen.eos_token_id = None
    gen.pad_token_id = pad
    gen.do_sample = False
    for name in ("temperature", "top_p", "top_k"):
        setattr(gen, name, None)
    return model


def _hf_inputs(prompts: list[list[int]], device: torch.device) -> dict:
    # all prompts have the same length: left padding would add nothing, the mask is all ones
    ids = torch.tensor(prompts, dtype=torch.long, device=device)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


class HFGenerate:
    """transformers generate of the target: eager (dynamic cache) or static cache + compile."""

    def __init__(
        self,
        path: str,
        dtype: torch.dtype,
        device: torch.device,
        compiled: bool = False,
        compile_on_cpu: bool = False,
    ):
        self.name = "hf-compiled" if compiled else "hf"
        self.device, self.compiled = device, compiled
        if compiled:
            if device.type == "cpu" and not compile_on_cpu:
                raise Skipped(
                    "torch.compile on CPU takes about a minute per batch size and "
                    "has no CUDA graphs (pass --compile-on-cpu to run it anyway)"
                )
            try:
                from transformers import CompileConfig
            except ImportError as exc:
                raise Skipped(f"transformers has no CompileConfig: {exc}") from None
        self.model = load_hf(path, dtype, device)
        if compiled:
            gen = self.model.generation_config
            gen.cache_implementation = "static"
            mode = "reduce-overhead" if device.type == "cuda" else "default"
            config = CompileConfig(mode=mode)
            if device.type != "cuda" and hasattr(config, "_compile_all_devices"):
                # a private switch that transformers declares as `= None`
                config._compile_all_devices = True  # type: ignore[assignment]
            gen.compile_config = config

    @torch.inference_mode()
    def run(self, prompts: list[list[int]], new_tokens: int) -> Outcome:
        inputs = _hf_inputs(prompts, self.device)
        before = _compiled_graphs()
        sync(self.device)
        start = time.perf_counter()
        out = self.model.generate(**inputs, max_new_tokens=new_tokens)
        generated = out[:, inputs["input_ids"].shape[1] :].tolist()
        wall = time.perf_counter() - start
        extra: dict[str, Any] = {"token_ids": generated}
        if self.compiled:
            extra["compiled"] = (
                bool(getattr(self.model, "_compiled_call", None)) or _compiled_graphs() > before
            )
        return Outcome(tokens=sum(len(r) for r in generated), wall_s=wall, extra=extra)

    def close(self) -> None:
        del self.model
        if self.compiled:
            torch._dynamo.reset()
        free_memory()


def _compiled_graphs() -> int:
    try:
        from torch._dynamo.utils import counters

        return int(counters["stats"]["unique_graphs"])
    except Exception:  # noqa: BLE001 - a private counter; only a hint
        return 0


class _RoundRecorder:
    """Records (candidates, matches) of every assisted-generation round by wrapping
    AssistedCandidateGenerator.update_candidate_strategy (called once per target forward
    with the target's scores over candidates + 1 positions and the number of matches)."""

    def __init__(self):
        from transformers.generation import candidate_generator as cg

        self.cls: Any = cg.AssistedCandidateGenerator  # Any: its method is swapped below
        self.original = self.cls.update_candidate_strategy
        self.rounds: list[tuple[int, int]] = []

    def __enter__(self):
        original, rounds = self.original, self.rounds

        def wrapped(gen, input_ids, scores, num_matches, *args, **kwargs):
            rounds.append((int(scores.shape[1]) - 1, int(num_matches)))
            return original(gen, input_ids, scores, num_matches, *args, **kwargs)

        self.cls.update_candidate_strategy = wrapped
        return self

    def __exit__(self, *exc):
        self.cls.update_candidate_strategy = self.original


class HFAssisted:
    """transformers assisted generation: the same draft, k candidates per round."""

    name = "hf-assisted"

    def __init__(
        self,
        target: str,
        draft: str,
        dtype: torch.dtype,
        device: torch.device,
        draft_device: torch.device,
        draft_len: int | str,
    ):
        self.device = device
        self.model = load_hf(target, dtype, device)
        self.draft = load_hf(draft, dtype, draft_device)
        gen = self.draft.generation_config
        if draft_len == "auto":  # transformers' own adaptive draft length
            gen.num_assistant_tokens, gen.num_assistant_tokens_schedule = 4, "heuristic"
        else:
            gen.num_assistant_tokens, gen.num_assistant_tokens_schedule = draft_len, "constant"
        gen.assistant_confidence_threshold = 0.0  # no early stop: always k candidates

    @torch.inference_mode()
    def run(self, prompts: list[list[int]], new_tokens: int) -> Outcome:
        if len(prompts) != 1:
            raise Skipped("transformers assisted generation supports batch size 1 only")
        inputs = _hf_inputs(prompts, self.device)
        with _RoundRecorder() as rec:
            sync(self.device)
            start = time.perf_counter()
            out = self.model.generate(
                **inputs, assistant_model=self.draft, max_new_tokens=new_tokens
            )
            generated = out[:, inputs["input_ids"].shape[1] :].tolist()
            wall = time.perf_counter() - start
        tokens = sum(len(r) for r in generated)
        result = Outcome(tokens=tokens, wall_s=wall, extra={"token_ids": generated})
        if rec.rounds:
            proposed = sum(c for c, _ in rec.rounds)
            kept = sum(m for _, m in rec.rounds)
            tested = sum(m + (1 if m < c else 0) for c, m in rec.rounds)
            result.rounds = len(rec.rounds)
            result.acceptance_rate = kept / proposed if proposed else None
            result.mean_accepted_tokens = tokens / len(rec.rounds)
            result.alpha = kept / tested if tested else None
        return result

    def close(self) -> None:
        del self.model, self.draft
        free_memory()
