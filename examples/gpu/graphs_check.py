"""GPU check of the static-shape / CUDA-graph step path (runtime/models/runners/step_runner.py).

1. Exactness: a batch of ragged prompts decoded greedily in float32, once through the
   eager forward_extend and once through StepRunner (CUDA graphs): logits and tokens compared.
2. No host synchronisation inside a round: a draft proposal of k tokens and the target's
   verification run under torch.cuda.set_sync_debug_mode("error").
3. Step times, eager vs graphs, for the target's decode and verify steps.

    python examples/gpu/graphs_check.py --shape 1b --out graphs.json     # on a GPU
    python examples/gpu/graphs_check.py --shape tiny --device cpu         # CPU smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))
from runtime.models import load_model
from runtime.models.loading.synthetic import build_pair
from runtime.models.runners.step_runner import StepRunner
from runtime.worker.draft_shard import DraftShard
from runtime.worker.target_shard import TargetShard

SLOTS, CACHE_LEN, K = 4, 640, 4


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def decode(model, device, prompts, steps, graphs: bool):
    """Greedy decode of every prompt (batch = len(prompts)); returns (tokens, last logits)."""
    model.allocate_cache(SLOTS, CACHE_LEN)
    runner = StepRunner(model, device, SLOTS, K + 1, cuda_graphs=graphs)
    runner.static = graphs
    slots = list(range(len(prompts)))
    width = max(len(p) for p in prompts)
    ids = torch.tensor([p + [0] * (width - len(p)) for p in prompts], device=device)
    lens = [len(p) for p in prompts]
    logits = runner.run(ids, slots, [0] * len(slots), lens)
    token = logits[
        torch.arange(len(slots), device=device), torch.tensor(lens, device=device) - 1
    ].argmax(-1)
    out = [token]
    for i in range(steps - 1):
        logits = runner.run(token[:, None], slots, [n + i for n in lens], [1] * len(slots))
        token = logits[:, -1].argmax(-1)
        out.append(token)
    return torch.stack(out, 1).tolist(), logits[:, -1].float().clone()


def exactness(target: str, device, steps: int) -> dict:
    model = load_model(target, torch.float32, device)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, model.vocab_size, (n,), generator=g).tolist() for n in (37, 5, 300)]
    eager_tokens, eager_logits = decode(model, device, prompts, steps, graphs=False)
    graph_tokens, graph_logits = decode(model, device, prompts, steps, graphs=True)
    return {
        "tokens_equal": eager_tokens == graph_tokens,
        "max_abs_logit_diff": (eager_logits - graph_logits).abs().max().item(),
        "steps": steps,
        "batch": len(prompts),
    }


def host_syncs(draft: str, target: str, device, dtype) -> dict:
    dshard = DraftShard(load_model(draft, dtype, device), device, SLOTS, CACHE_LEN, max_step_len=2)
    tshard = TargetShard(
        load_model(target, dtype, device), device, SLOTS, CACHE_LEN, max_step_len=K + 1
    )
    slots, prompts = [0, 1], [[5, 6, 7, 8, 9], [10, 11, 12]]
    for shard in (dshard, tshard):
        shard.prefill(slots, prompts)
    result = {}
    for attempt in ("warm-up (captures)", "checked"):
        mode = "error" if attempt == "checked" and device.type == "cuda" else 0
        if device.type == "cuda":
            torch.cuda.set_sync_debug_mode(mode)
        try:
            tokens, _ = dshard.propose(slots, K)
            accepted, nxt = tshard.verify(slots, tokens)
            result["round_without_host_sync"] = True
        except RuntimeError as exc:
            result["round_without_host_sync"] = False
            result["sync_error"] = str(exc)[:300]
        finally:
            if device.type == "cuda":
                torch.cuda.set_sync_debug_mode(0)
        rows = torch.cat([tokens, accepted[:, None], nxt[:, None]], 1).tolist()
        dshard.commit(slots, [r[:K] for r in rows], [r[K] for r in rows], [r[K + 1] for r in rows])
        tshard.commit(slots, [r[K] for r in rows], [r[K + 1] for r in rows])
    return result


def step_times(target: str, device, dtype, iters: int = 30) -> dict:
    from runtime.bench.metrics import step_time

    model = load_model(target, dtype, device)
    model.allocate_cache(SLOTS, CACHE_LEN)
    out = {}
    for graphs in (False, True):
        runner = StepRunner(model, device, SLOTS, K + 1, cuda_graphs=graphs)
        runner.static = graphs  # eager: the dynamic forward_extend path
        for tokens in (1, K + 1):
            name = f"{'graphs' if graphs else 'eager'}_{tokens}_token_step_ms"
            out[name] = 1e3 * step_time(runner, device, 1, tokens, 200, iters=iters)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="1b")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(False)  # as the workers do
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.time()
        d32, t32 = build_pair(
            f"{tmp}/f32", args.shape, 2, 0.02, 0, torch.float32, gen_device=device
        )
        report = {
            "shape": args.shape,
            "device": str(device),
            "exactness_float32": exactness(t32, device, args.steps),
        }
        if dtype != torch.float32:
            d, t = build_pair(f"{tmp}/bf16", args.shape, 2, 0.02, 0, dtype, gen_device=device)
        else:
            d, t = d32, t32
        report["host_syncs"] = host_syncs(d, t, device, dtype)
        report["step_times"] = step_times(t, device, dtype)
        report["wall_s"] = time.time() - t0
    print(json.dumps(report, indent=1))
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(report, fh, indent=1)
    ok = (
        report["exactness_float32"]["tokens_equal"]
        and report["host_syncs"]["round_without_host_sync"]
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
