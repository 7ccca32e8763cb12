"""The bench's derived figures: what each ok row of the table gets from the others and from
the measured costs (runtime.bench.metrics has the formulas): tokens equal to the target's,
the speed-up over it, the roofline fractions of the `target` rows, and on the `spec` rows
alpha, c, the theoretical speed-up at the best k, the efficiencies and the overlap's gain.
"""

from __future__ import annotations

from runtime.bench import metrics
from runtime.bench.settings import Setup


def derive(
    rows: list[dict],
    st: Setup,
    *,
    tokens: dict[tuple[str, int], list[list[int]] | None],
    info: dict,
    step_costs: dict[int, dict],
    context: float,
) -> None:
    """Add the derived figures to `rows` (sorted): `tokens` are each (mode, batch size)'s
    generated ids, `info` holds the copy bandwidth and the target's bytes, `step_costs` the
    draft's and target's step times per batch size, `context` the mean cache position."""
    target = {r["batch_size"]: r for r in rows if r["mode"] == "target" and r["status"] == "ok"}
    bw = info.get("copy_bandwidth_bytes_per_s")
    wbytes = info.get("target_weight_bytes")
    for r in rows:
        if r["status"] != "ok":
            continue
        bsz = r["batch_size"]
        ref = tokens.get(("target", bsz))
        if r["mode"] != "target" and ref is not None:
            r["tokens_equal_target"] = tokens.get((r["mode"], bsz)) == ref
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
            _decode_roofline(r, bw, wbytes, info.get("target_kv_position_bytes"), context)
        if r["mode"].startswith("spec") and bsz in step_costs:
            _spec_figures(r, st, step_costs[bsz])
            _decode_efficiency(r, base)
    _overlap_figures(rows, st)


def _decode_roofline(
    r: dict, bw: float, wbytes: int, kv_position: int | None, context: float
) -> None:
    """decode_roofline_fraction: the decode steps' byte limit (the weights plus each row's
    KV at the mean context, prompt + new_tokens / 2: `context`) over their measured time, the
    call's wall time less its first token (long prompts: the prefill is not decoding)."""
    ttft = r.get("time_to_first_token_s") or [None]
    steps = r["generated_tokens"] // r["batch_size"] - 1
    if not kv_position or ttft[0] is None or steps < 1:
        return
    step_bytes = wbytes + kv_position * context * r["batch_size"]
    r["decode_roofline_fraction"] = (step_bytes / bw) / ((r["wall_s"] - ttft[0]) / steps)


def _spec_figures(r: dict, st: Setup, costs: dict) -> None:
    r.update(draft_step_s=costs["draft_step_s"], target_decode_step_s=costs["target_decode_step_s"])
    verify = costs["target_verify_step_s"]
    alpha = r.get("alpha")
    if alpha is None and r.get("mean_accepted_tokens") and st.draft_len != "auto":
        alpha = metrics.alpha_from_tokens_per_round(r["mean_accepted_tokens"], int(st.draft_len))
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


def _overlap_figures(rows: list[dict], st: Setup) -> None:
    """On each `spec` row that has a `spec-sequential` one beside it: overlap on / off
    (measured, and by the model at the row's alpha, k and c)."""
    sequential = {
        r["batch_size"]: r
        for r in rows
        if r["mode"] == "spec-sequential" and r["status"] == "ok" and r["tokens_per_s"]
    }
    for r in rows:
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
