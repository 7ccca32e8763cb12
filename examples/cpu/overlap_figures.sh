#!/usr/bin/env bash
# The overlap figures of docs/configuration.md ("Overlapped speculation"), on two CPU cores:
#   bash examples/cpu/overlap_figures.sh OUTDIR [EPS...]          (default EPS: 0.0425 0.045)
# For each EPS: the `small` synthetic pair with its 2-layer draft (bf16), draft on cpu:0 and
# target on cpu:1 with one thread each, draft_len 2, greedy, 32-token prompts, 128 new tokens
# (overlap_bench.engine_config, written out as the bench's config); `tandem bench` with
# overlap on and off side by side (7 timed calls each, taking turns), then
# examples/cpu/overlap_bench.py (9 prompts, one call of each mode per prompt). On a host with
# more cores, CORES="0,1" (say) runs everything under `taskset -c $CORES`; PIN=0 leaves the
# workers unpinned (TANDEM_CPU_AFFINITY); DRAFT_LAYERS=3 (say) drafts with the target's first 3
# layers instead of 2 (a dearer draft: c ≈ 0.33 instead of ≈ 0.25). Writes OUTDIR/eps-<EPS>.json
# and .log (OUTDIR/l<DRAFT_LAYERS>-eps-<EPS>.* for a draft other than 2 layers).
set -u
OUT=${1:?usage: overlap_figures.sh OUTDIR [EPS...]}; shift
mkdir -p "$OUT"
SYN=${SYN:-/tmp/tandem-ov}
LAYERS=${DRAFT_LAYERS:-2}
TAG=$([ "$LAYERS" = 2 ] || echo "l$LAYERS-")
export TANDEM_CPU_AFFINITY=${PIN:-1} CUDA_VISIBLE_DEVICES=
run() { if [ -n "${CORES:-}" ]; then taskset -c "$CORES" "$@"; else "$@"; fi; }
for eps in "${@:-0.0425 0.045}"; do
    for e in $eps; do
        pair="$SYN/${TAG}eps-$e"
        [ -d "$pair/target" ] || python -c "from runtime.models.loading.synthetic import build_pair; \
            build_pair('$pair', 'small', $LAYERS, eps=$e)"
        python -c "import sys, yaml; sys.path.insert(0, 'examples/cpu'); \
            from overlap_bench import engine_config; \
            yaml.safe_dump(engine_config('$pair', 2, True), open('$pair/config.yaml', 'w'))"
        start=$SECONDS
        { run python -m launcher bench "$pair/config.yaml" --modes spec,spec-sequential \
              --prompt-len 32 --new-tokens 128 --repeats 7 --out "$OUT/${TAG}eps-$e.json"
          run python examples/cpu/overlap_bench.py "$pair" --draft-len 2 --new-tokens 128 \
              --calls 9; } > "$OUT/${TAG}eps-$e.log" 2>&1
        echo "== ${TAG}eps $e (rc $?, $((SECONDS - start)) s)"
        grep '^|\|^overlap\|^on / off' "$OUT/${TAG}eps-$e.log"
    done
done
