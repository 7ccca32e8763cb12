"""The transformers baselines: `hf` and `hf-compiled` (HFGenerate: `generate` of the target,
eager or with a static cache and torch.compile) and `hf-assisted` (HFAssisted: assisted
generation with the same draft); what each measures: runtime.bench.modes."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from runtime.bench.metrics import sync
from runtime.bench.modes import Outcome, Skipped, free_memory


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
