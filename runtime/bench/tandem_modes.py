"""tandem's own bench modes: `target` (TandemTarget: the target alone on tandem's model code, in
this process) and `spec` / `spec-sequential` (TandemSpec: the Engine, overlap on or off); what
each measures: runtime.bench.modes."""

from __future__ import annotations

import time

import torch

from runtime.bench.metrics import DeviceClock, sync
from runtime.bench.modes import Outcome, Skipped, free_memory


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


class TandemSpec:
    """tandem's Engine: speculative decoding with draft and target on the configured devices.
    `overlap=False` (the `spec-sequential` mode) runs the same with speculation.overlap off,
    for side-by-side runs on disjoint devices; where the config does not overlap anyway it is
    skipped."""

    name = "spec"

    def __init__(self, config: dict, overlap: bool | None = None, sampling: dict | None = None):
        from runtime.api.engine import Engine
        from runtime.config import load_config

        self.sampling = {"temperature": 0.0, **(sampling or {})}  # bench --sampling
        self.draft_len = config["speculation"]["draft_len"]
        if overlap is not None:
            if not load_config(config, check_files=False, check_devices=False).overlapped:
                raise Skipped("draft and target share devices: spec is sequential already")
            config = {**config, "speculation": {**config["speculation"], "overlap": overlap}}
        self.engine = Engine.launch(config)

    def run(self, prompts: list[list[int]], new_tokens: int) -> Outcome:
        start = time.perf_counter()
        outs = self.engine.generate(
            prompt_token_ids=[list(p) for p in prompts], max_new_tokens=new_tokens, **self.sampling
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
