"""`tandem bench`: run the modes side by side on the same prompts and derive the figures.

Order: the in-process phase (the `target` mode, the copy bandwidth, the step costs behind c),
then `spec` and `spec-sequential` (overlap on and off: both Engines up at once, one for all
batch sizes each, their timed calls taking turns), then the transformers modes; each phase
frees its models before the next loads. Every mode gets `warmup` untimed calls of the same
shape before `repeats` timed ones (the median is kept). settings.py resolves the settings
into the pair and the Engine config (prefix caching off unless asked for: it says why);
figures.py derives the figures of the table from the rows and the measured step costs.
"""

from __future__ import annotations

import shutil
import sys
import traceback
from dataclasses import asdict

import torch

from runtime.bench import metrics
from runtime.bench.figures import derive
from runtime.bench.hf_modes import HFAssisted, HFGenerate
from runtime.bench.modes import MODES, Outcome, Skipped, free_memory, timed_side_by_side
from runtime.bench.report import hardware, now, row, versions
from runtime.bench.settings import (  # noqa: F401
    BenchSettings,
    Setup,
    _engine_device,
    _kmax,
    _torch_device,
    resolve,
)
from runtime.bench.tandem_modes import TandemSpec, worker_backends
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
        self.progress("measuring the copy bandwidth")
        self.info["copy_bandwidth_bytes_per_s"] = metrics.copy_bandwidth(st.target_device)
        job = self._target_job(st)
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

    def _target_job(self, st: Setup) -> TargetJob:
        """The target phase's work: the `target` mode if asked for, and the verify steps'
        costs at each k the spec modes may use."""
        kmax = _kmax(st.draft_len)
        return TargetJob(
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

    # -- everything ---------------------------------------------------------------------------
    def run(self) -> dict:
        st = resolve(self.s)
        try:  # the synthetic pair's temporary folder goes whatever happens
            if st.target_device.type == "cuda":
                torch.cuda.set_device(st.target_device)
            self.prompts = make_prompts(st.target, self.s)
            with worker_backends():
                self._in_process(st)
            self._engine_and_hf_modes(st)
        finally:
            if st.cleanup:
                shutil.rmtree(st.cleanup, ignore_errors=True)
        order = {m: i for i, m in enumerate(MODES)}
        self.rows.sort(key=lambda r: (r["batch_size"], order[r["mode"]]))
        derive(
            self.rows,
            st,
            tokens=self.tokens,
            info=self.info,
            step_costs=self.step_costs,
            context=self.s.prompt_len + self.s.new_tokens / 2,
        )
        return self._report(st)

    def _engine_and_hf_modes(self, st: Setup) -> None:
        """The Engine's modes, then the transformers ones, each phase freeing its models."""
        # overlap on and off side by side: both engines up, their calls taking turns
        self._modes(
            {
                "spec": lambda: TandemSpec(st.engine_config, sampling=self.s.sampling),
                "spec-sequential": lambda: TandemSpec(
                    st.engine_config, overlap=False, sampling=self.s.sampling
                ),
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
                    compile_on_cpu=self.s.compile_on_cpu,
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

    def _report(self, st: Setup) -> dict:
        """The report: the settings as resolved, the machine, and the rows."""
        settings = asdict(self.s)
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
