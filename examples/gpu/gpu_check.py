"""GPU check for tensor-parallel layouts and sampling acceptance modes (issues 3 and 4).

Builds a synthetic pair (runtime/synthetic.py), then runs `python -m launcher run` (spawn form)
for each layout: float32 greedy must equal the single-device run token for token; bf16 runs
report tokens/s and how many leading tokens match the float32 output. Then, with the draft on
device 0 and the target on device 1, temperature-1 sampling with `tokens` vs `logits`
acceptance (tokens/s), and a profiled run giving the time per round spent moving the draft's
probabilities. Prints a markdown table and writes JSON.

    python examples/gpu/gpu_check.py --shape 1b --out results.json          # on a 2-GPU machine
    python examples/gpu/gpu_check.py --shape tiny --cpu                      # CPU smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import yaml

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))
from runtime.models.loading.synthetic import build_pair
from runtime.speculation.retokenize import common_prefix

LAYOUTS = {  # name: (draft devices, target devices)
    "both [0]": ([0], [0]),
    "draft [0] + target [1]": ([0], [1]),
    "draft [0] + target [0, 1]": ([0], [0, 1]),
    "both [0, 1]": ([0, 1], [0, 1]),
}


def devices(ids, cpu: bool):
    return [f"cpu:{i}" for i in ids] if cpu else list(ids)


def run(cfg: dict, tmp: str, args: list[str], env_extra: dict | None = None) -> dict:
    path = os.path.join(tmp, "c.yaml")
    with open(path, "w") as fh:
        yaml.safe_dump(cfg, fh)
    env = dict(os.environ, **(env_extra or {}))
    start = time.perf_counter()
    res = subprocess.run(
        [sys.executable, "-m", "launcher", "run", path, *args, "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    wall = time.perf_counter() - start
    if res.returncode != 0:
        raise RuntimeError(f"run failed ({res.returncode}):\n{res.stderr[-3000:]}")
    out = json.loads([line for line in res.stdout.splitlines() if line.startswith("{")][0])
    out["wall_s"] = wall
    return out


def config(draft, target, d_dev, t_dev, dtype, acceptance="tokens", k=4):
    return {
        "draft": {"model": draft, "devices": d_dev, "dtype": dtype},
        "target": {"model": target, "devices": t_dev, "dtype": dtype},
        "speculation": {"draft_len": k, "acceptance": acceptance},
        "runtime": {"max_batch_size": 1, "max_seq_len": 1024},
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="1b")
    ap.add_argument("--eps", type=float, default=0.02)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--cpu", action="store_true")
    ap.add_argument("--out")
    a = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="tandem-gpu-")
    draft, target = build_pair(tmp, a.shape, draft_layers=2, eps=a.eps)
    prompt = ",".join(str(1 + (i * 7919) % 30000 % 250) for i in range(32))
    args = ["--prompt-ids", prompt, "--max-new-tokens", str(a.new_tokens)]
    rows, results = [], {"shape": a.shape, "eps": a.eps, "layouts": {}, "sampling": {}}
    ref = None
    for name, (d, t) in LAYOUTS.items():
        r32 = run(config(draft, target, devices(d, a.cpu), devices(t, a.cpu), "float32"), tmp, args)
        ref = ref or r32["token_ids"]
        r16 = run(
            config(draft, target, devices(d, a.cpu), devices(t, a.cpu), "bfloat16"), tmp, args
        )
        exact = r32["token_ids"] == ref
        results["layouts"][name] = {"float32": r32, "bfloat16": r16, "float32_exact": exact}
        rows.append(
            f"| {name} | {'yes' if exact else 'NO'} | "
            f"{r32['stats']['tokens_per_s']:.1f} | {r16['stats']['tokens_per_s']:.1f} | "
            f"{common_prefix(r16['token_ids'], ref)}/{len(ref)} | "
            f"{r16['stats']['acceptance_rate']:.2f} |"
        )
    print(
        "| layout | float32 token-exact vs both [0] | float32 tok/s | bf16 tok/s | "
        "bf16 tokens matching float32 | bf16 acceptance |"
    )
    print("|---|---|---|---|---|---|")
    print("\n".join(rows))
    d, t = devices([0], a.cpu), devices([1], a.cpu)
    srows = []
    for acceptance in ("tokens", "logits"):
        cfg = config(draft, target, d, t, "bfloat16", acceptance)
        sargs = args + ["--temperature", "1.0", "--seed", "7"]
        timed = run(cfg, tmp, sargs)
        prof = run(cfg, tmp, sargs, {"TANDEM_PROFILE": "1"})["stats"]["profile"]
        results["sampling"][acceptance] = {"run": timed, "profile": prof}
        moved = prof.get("rank1.draft_probs_transfer_s", 0.0) * 1e3
        srows.append(
            f"| {acceptance} | {timed['stats']['tokens_per_s']:.1f} | "
            f"{timed['stats']['acceptance_rate']:.2f} | "
            f"{timed['stats']['mean_accepted_tokens']:.2f} | {moved:.3f} |"
        )
    print(
        "\n| acceptance (T=1, bf16, draft [0], target [1]) | tok/s | acceptance | "
        "tokens/round | ms/round moving draft probs |"
    )
    print("|---|---|---|---|---|")
    print("\n".join(srows))
    if a.out:
        with open(a.out, "w") as fh:
            json.dump(results, fh, indent=1)


if __name__ == "__main__":
    main()
