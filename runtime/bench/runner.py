"""`tandem bench`: run the modes side by side on the same prompts and derive the figures.

Order: the in-process phase (the `target` mode, the copy bandwidth, the step costs behind c),
then `spec` and `spec-sequential` (overlap on and off: both Engines up at once, one for all
batch sizes each, their timed calls taking turns), then the transformers modes; each phase
frees its models before the next loads. Every mode gets `warmup` untimed calls of the same
shape before `repeats` timed ones (the median is kept). settings.py resolves the settings
into the pair and the Engine config (prefix caching off unless asked for: it says why).
"""

from __future__ import annotations

import shutil
import sys
import traceback
from dataclasses import asdict

import torch

from runtime.bench import metrics
from runtime.bench.modes import (
    MODES,
    HFAssisted,
    HFGenerate,
    Outcome,
    Skipped,
    TandemSpec,
    free_memory,
    timed_side_by_side,
    worker_backends,
)
from runtime.bench.report import hardware, now, row, versions
from runtime.bench.settings import (  # noqa: F401
    BenchSettings,
    Setup,
    _engine_device,
    _kmax,
    _torch_device,
    resolve,
)
from runtime.bench.tp_target import TargetJob, measure, run_tensor_parallel

C_SOURCE = (
    "in-process: median time of one draft decode step (1 token per row) / one target "
    "verify step (k+1 tokens per row), both through the workers' StepRunner (CUDA "
    "graphs unless --no-cuda-graphs) on their configured devices (on CPU with the "
    "threads each engine worker gets), at cache position prompt_len + new_tokens / 2"
)


def make_prompts(target: str, s: BenchSettings) -> list[list[int]]:
    """max(batch_sizes) distinct prompts of random token ids (seeded); batch B uses the first B."""
    from runtime.models.loading.loader import load_config

    vocab = int(load_config(target).vocab_size)
    gen = torch.Generator().manual_seed(s.seed)
    ids = torch.randint(0, vocab, (max(s.batch_sizes), s.prompt_len), generator=gen)
    return ids.tolist()


def _ok_row(name: str, bsz: int, out: Outcome, **values) -> dict:
    extra = {k: v for k, v in out.extra.items() if k != "token_ids"}
    return row(
        name,
        bsz,
        tokens_per_s=out.tokens_per_s,
        acceptance_rate=out.acceptance_rate,
        mean_accepted_tokens=out.mean_accepted_tokens,
        alpha=out.alpha,
        rounds=out.rounds,
        generated_tokens=out.tokens,
        wall_s=out.wall_s,
        **extra,
        **values,
    )


def _decode_efficiency(r: dict, base: dict | None) -> None:
    """decode_efficiency: the decode steps' speed-up over the target's (each call's wall time
    less its first token) over the theoretical speed-up. With long prompts the first token
    is much of a call, and `efficiency` counts it; this does not."""
    first = (r.get("time_to_first_token_s") or [None])[0]
    base_first = ((base or {}).get("time_to_first_token_s") or [None])[0]
    if (
        base is None
        or None in (first, base_first, r.get("theoretical_speedup"))
        or not base["tokens_per_s"]
    ):
        return
    spec_s = (r["wall_s"] - first) / r["generated_tokens"]
    target_s = (base["wall_s"] - base_first) / base["generated_tokens"]
    if spec_s > 0:
        r["decode_efficiency"] = target_s / spec_s / r["theoretical_speedup"]


class Bench:
    def __init__(self, settings: BenchSettings):
        settings.check()
        self.s = settings
        self.rows: list[dict] = []
        self.tokens: dict[tuple[str, int], list[list[int]] | None] = {}
        self.info: dict = {"c_source": C_SOURCE}
        self.step_costs: dict[int, dict] = {}

    def progress(self, text: str) -> None:
        print(f"bench: {text}", file=sys.stderr, flush=True)

    # -- modes over all batch sizes, side by side ---------------------------------------------
    def _load(self, name: str, factory):
        """The mode loaded, or None with its rows skipped or failed."""
        self.progress(f"{name}: loading")
        try:
            return factory()
        except Skipped as exc:
            self.rows += [row(name, b, "skipped", str(exc)) for b in self.s.batch_sizes]
        except Exception as exc:  # noqa: BLE001 - reported in the table, exit code 1
            traceback.print_exc()
            self.rows += [
                row(name, b, "failed", f"{type(exc).__name__}: {exc}") for b in self.s.batch_sizes
            ]
        return None

    def _modes(self, factories: dict) -> None:
        """The requested ones of these modes, loaded at once and timed side by side
        (modes.timed_side_by_side) at every batch size."""
        loaded = {}
        try:
            for name, factory in factories.items():
                if name in self.s.modes and (mode := self._load(name, factory)) is not None:
                    loaded[name] = mode
            for bsz in self.s.batch_sizes if loaded else ():
                self._batch(loaded, bsz)
        finally:
            for mode in loaded.values():
                mode.close()

    def _batch(self, loaded: dict, bsz: int) -> None:
        self.progress(f"{', '.join(loaded)}: batch {bsz}")
        try:
            outs = timed_side_by_side(
                loaded, self.prompts[:bsz], self.s.new_tokens, self.s.warmup, self.s.repeats
            )
        except Skipped as exc:
            self.rows += [row(name, bsz, "skipped", str(exc)) for name in loaded]
            return
        except Exception as exc:  # noqa: BLE001
            traceback.print_exc()
            self.rows += [
                row(name, bsz, "failed", f"{type(exc).__name__}: {exc}") for name in loaded
            ]
            return
        for name, out in outs.items():
            self.tokens[(name, bsz)] = out.extra.get("token_ids")
            self.rows.append(_ok_row(name, bsz, out))
            if name == "spec":
                self.info.setdefault("spec_server_stats", {})[str(bsz)] = loaded[
                    name
                ].server_stats()

    # -- the target phase: target mode, bandwidth, step costs ---------------------------------
    def _in_process(self, st: Setup) -> None:
        if not {"target", "spec", "spec-sequential"} & set(self.s.modes):
            return
        kmax = _kmax(st.draft_len)
        self.progress("measuring the copy bandwidth")
        self.info["copy_bandwidth_bytes_per_s"] = metrics.copy_bandwidth(st.target_device)
        job = TargetJob(
            path=st.target,
            dtype=str(st.target_dtype).removeprefix("torch."),
            quantization=st.target_quantization,
            devices=[str(d) if d.type == "cuda" else "cpu" for d in st.target_devices],
            max_batch=max(self.s.batch_sizes),
            cache_len=self.s.prompt_len + self.s.new_tokens + kmax + 1,
            max_step_len=kmax + 1,
            cuda_graphs=self.s.cuda_graphs,
            prompts=self.prompts,
            batch_sizes=self.s.batch_sizes,
            new_tokens=self.s.new_tokens,
            warmup=self.s.warmup,
            repeats=self.s.repeats,
            run_target="target" in self.s.modes,
            verify_ks=(list(range(1, kmax + 1)) if st.draft_len == "auto" else [kmax])
            if {"spec", "spec-sequential"} & set(self.s.modes)
            else [],
            position=self.s.prompt_len + self.s.new_tokens // 2,
            cpu_threads=metrics.worker_cpu_threads(st.draft_device, st.target_devices),
        )
        where = f"on {st.target_tp} TP ranks" if st.target_tp > 1 else "in-process"
        self.progress(f"target phase {where}: loading")
        try:
            report = run_tensor_parallel(job) if st.target_tp > 1 else measure(job)
        except Exception as exc:  # noqa: BLE001 - reported in the table, exit code 1
            traceback.print_exc()
            reason = f"{type(exc).__name__}: {exc}"
            if "target" in self.s.modes:
                self.rows += [row("target", b, "failed", reason) for b in self.s.batch_sizes]
            self.info["c_source"] = f"not measured: {reason}"
            return
        self.info["target_weight_bytes"] = report["weight_bytes"]
        self.info["target_kv_position_bytes"] = report.get("kv_position_bytes")
        for key, out in report["target"].items():
            if isinstance(out, str):
                self.rows.append(row("target", int(key), "failed", out))
                continue
            out = Outcome(**out)
            self.tokens[("target", int(key))] = out.extra.get("token_ids")
            self.rows.append(_ok_row("target", int(key), out))
        if isinstance(report["steps"], str):
            self.info["c_source"] = f"not measured: {report['steps']}"
        elif report["steps"]:
            self._draft_costs(st, job, report["steps"])

    def _draft_costs(self, st: Setup, job: TargetJob, target_steps: dict) -> None:
        from runtime.models import load_model
        from runtime.models.runners.step_runner import StepRunner

        self.progress("measuring the draft step cost (c)")
        try:
            draft = load_model(
                st.draft, st.draft_dtype, st.draft_device, quantization=st.draft_quantization
            )
            draft.allocate_cache(job.max_batch, job.cache_len)
            runner = StepRunner(draft, st.draft_device, job.max_batch, 1, self.s.cuda_graphs)
            for bsz in self.s.batch_sizes:
                steps = target_steps[str(bsz)]
                with metrics.cpu_threads(st.draft_device, job.cpu_threads):
                    draft_step_s = metrics.step_time(runner, st.draft_device, bsz, 1, job.position)
                self.step_costs[bsz] = {
                    "draft_step_s": draft_step_s,
                    "target_decode_step_s": steps["target_decode_step_s"],
                    "target_verify_step_s": {
                        int(k): v for k, v in steps["target_verify_step_s"].items()
                    },
                }
            del draft, runner
        except Exception as exc:  # noqa: BLE001
            traceback.print_exc()
            self.info["c_source"] = f"not measured: {type(exc).__name__}: {exc}"
        free_memory()

    # -- derived figures ----------------------------------------------------------------------
    def _derive(self, st: Setup) -> None:
        target = {
            r["batch_size"]: r for r in self.rows if r["mode"] == "target" and r["status"] == "ok"
        }
        bw = self.info.get("copy_bandwidth_bytes_per_s")
        wbytes = self.info.get("target_weight_bytes")
        for r in self.rows:
            if r["status"] != "ok":
                continue
            bsz = r["batch_size"]
            ref = self.tokens.get(("target", bsz))
            if r["mode"] != "target" and ref is not None:
                r["tokens_equal_target"] = self.tokens.get((r["mode"], bsz)) == ref
            if r["mode"].startswith("hf") and (st.target_quantization or st.draft_quantization):
                r["note"] = f"{str(st.target_dtype).removeprefix('torch.')} weights, not FP8"
            base = target.get(bsz)
            if (
                r["mode"] != "target"
                and base is not None
                and base["tokens_per_s"]
                and r["tokens_per_s"]
            ):
                r["speedup_over_target"] = r["tokens_per_s"] / base["tokens_per_s"]
            if r["mode"] == "target" and bw and wbytes:
                seconds_per_step = r["wall_s"] / (r["generated_tokens"] / bsz)
                r["roofline_fraction"] = (wbytes / bw) / seconds_per_step
                self._decode_roofline(r, bw, wbytes)
            if r["mode"].startswith("spec") and bsz in self.step_costs:
                self._spec_figures(r, st, self.step_costs[bsz])
                _decode_efficiency(r, base)
        self._overlap_figures(st)

    def _decode_roofline(self, r: dict, bw: float, wbytes: int) -> None:
        """decode_roofline_fraction: the decode steps' byte limit (the weights plus each row's
        KV at the mean context, prompt + new_tokens / 2) over their measured time, the
        call's wall time less its first token (long prompts: the prefill is not decoding)."""
        kv_position = self.info.get("target_kv_position_bytes")
        ttft = r.get("time_to_first_token_s") or [None]
        steps = r["generated_tokens"] // r["batch_size"] - 1
        if not kv_position or ttft[0] is None or steps < 1:
            return
        context = self.s.prompt_len + self.s.new_tokens / 2
        step_bytes = wbytes + kv_position * context * r["batch_size"]
        r["decode_roofline_fraction"] = (step_bytes / bw) / ((r["wall_s"] - ttft[0]) / steps)

    def _overlap_figures(self, st: Setup) -> None:
        """On each `spec` row that has a `spec-sequential` one beside it: overlap on / off
        (measured, and by the model at the row's alpha, k and c)."""
        sequential = {
            r["batch_size"]: r
            for r in self.rows
            if r["mode"] == "spec-sequential" and r["status"] == "ok" and r["tokens_per_s"]
        }
        for r in self.rows:
            off = sequential.get(r["batch_size"])
            if r["mode"] != "spec" or r["status"] != "ok" or off is None:
                continue
            r["overlap_speedup"] = r["tokens_per_s"] / off["tokens_per_s"]
            note = f"overlap {r['overlap_speedup']:.2f}x off"
            if st.draft_len != "auto" and r.get("alpha") is not None and r.get("c"):
                r["theoretical_overlap_speedup"] = metrics.theoretical_overlap_speedup(
                    r["alpha"], int(st.draft_len), r["c"]
                )
                note += f" (model {r['theoretical_overlap_speedup']:.2f}x)"
            r["note"] = "; ".join(filter(None, (r.get("note"), note)))

    def _spec_figures(self, r: dict, st: Setup, costs: dict) -> None:
        r.update(
            draft_step_s=costs["draft_step_s"], target_decode_step_s=costs["target_decode_step_s"]
        )
        verify = costs["target_verify_step_s"]
        alpha = r.get("alpha")
        if alpha is None and r.get("mean_accepted_tokens") and st.draft_len != "auto":
            alpha = metrics.alpha_from_tokens_per_round(
                r["mean_accepted_tokens"], int(st.draft_len)
            )
            r["alpha"] = alpha
        if alpha is None:
            return
        # auto: the best fixed k at this alpha (what choosing k each round can at most reach)
        best = max(
            (
                (metrics.theoretical_speedup(alpha, k, costs["draft_step_s"] / v), k)
                for k, v in verify.items()
            ),
            key=lambda x: x[0],
        )
        r["theoretical_speedup"], k = best
        r["c"] = costs["draft_step_s"] / verify[k]
        r["target_verify_step_s"] = verify[k]
        if st.draft_len == "auto":
            r["theoretical_k"] = k
        if r.get("speedup_over_target") is not None:
            r["efficiency"] = r["speedup_over_target"] / r["theoretical_speedup"]

    # -- everything ---------------------------------------------------------------------------
    def run(self) -> dict:
        s = self.s
        st = resolve(s)
        if st.target_device.type == "cuda":
            torch.cuda.set_device(st.target_device)
        try:
            self.prompts = make_prompts(st.target, s)
            with worker_backends():
                self._in_process(st)
            # overlap on and off side by side: both engines up, their calls taking turns
            self._modes(
                {
                    "spec": lambda: TandemSpec(st.engine_config),
                    "spec-sequential": lambda: TandemSpec(st.engine_config, overlap=False),
                }
            )
            self._modes({"hf": lambda: HFGenerate(st.target, st.target_dtype, st.target_device)})
            self._modes(
                {
                    "hf-compiled": lambda: HFGenerate(
                        st.target,
                        st.target_dtype,
                        st.target_device,
                        compiled=True,
                        compile_on_cpu=s.compile_on_cpu,
                    )
                }
            )
            self._modes(
                {
                    "hf-assisted": lambda: HFAssisted(
                        st.target,
                        st.draft,
                        st.target_dtype,
                        st.target_device,
                        st.draft_device,
                        st.draft_len,
                    )
                }
            )
        finally:
            if st.cleanup:
                shutil.rmtree(st.cleanup, ignore_errors=True)
        order = {m: i for i, m in enumerate(MODES)}
        self.rows.sort(key=lambda r: (r["batch_size"], order[r["mode"]]))
        self._derive(st)
        settings = asdict(s)
        settings.update(
            draft=st.draft if not st.cleanup else None,
            target=st.target if not st.cleanup else None,
            draft_len=st.draft_len,
            dtype=str(st.target_dtype).split(".")[-1],
            device=str(st.target_device),
            engine_config=st.engine_config,
        )
        if st.cleanup:
            settings["engine_config"] = None  # its model paths were temporary
        return {
            "settings": settings,
            "date": now(),
            "hardware": hardware(st.target_device.type, st.target_device.index),
            "versions": versions(),
            **self.info,
            "results": self.rows,
        }


def run_bench(settings: BenchSettings) -> dict:
    return Bench(settings).run()


def failed(report: dict) -> list[dict]:
    return [r for r in report["results"] if r["status"] == "failed"]


__all__ = ["BenchSettings", "run_bench", "failed"]
