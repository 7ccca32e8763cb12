#!/usr/bin/env bash
# The H200 measurements in README.md and docs/benchmarks.md, phase by phase:
#   bash examples/h200_bench.sh OUTDIR check k4 auto-0.02 eps-0.05 auto-0.2 batch16
#   bash examples/h200_bench.sh OUTDIR fp8-auto-0.02 auto-0.02 fp8-70b-0.01   # README's table
#   bash examples/h200_bench.sh OUTDIR tp2-smoke 70b-0.01      # two H200s: target TP 2
#   bash examples/h200_bench.sh OUTDIR family-qwen3-8b family-olmo2-7b family-phi3-mini
#       (the other native families, issue 37: auto-0.02 on the synthetic shape of Qwen3-8B,
#       OLMo-2-1124-7B or Phi-3-mini, runtime/models/loading/synthetic_shapes.py; for OLMo 2
#       eps scales the post-norms of the layers from K on)
#   bash examples/h200_bench.sh OUTDIR profile spec-profile    # where the time goes
#   bash examples/h200_bench.sh OUTDIR fp8-check profile-fp8 profile-fp8-70b
#       (FP8 exactness and step times; the FP8 8b and 70b steps' kernels)
#   bash examples/h200_bench.sh OUTDIR kv-ttft kv-serve64 kv-serve256 kv-70b kv-fp8
#       (the paged KV cache in serving, examples/gpu/serving_kv.py: TTFT with a cached
#       2,000-token prefix; 64 x 128 and 256 x 2,000-token requests at once; 70b FP8;
#       kv_cache_dtype auto vs fp8 at 8k context)
#   bash examples/h200_bench.sh OUTDIR prompt-128 prompt-2048 prompt-8000 decode-32000 trt-70b
#       (long prompts, issue 36: 8b bf16 target and spec at batch 1 after a prompt of N
#       tokens, the table's ttft ms; decode-N: the target alone at an N-token context, its
#       decode roofline; trt-70b: TensorRT-LLM's published workload, 70b FP8 + draft, a
#       500-token prompt and 200 new tokens)
#   bash examples/h200_bench.sh OUTDIR mixed mixed-whole
#       (mixed traffic, examples/gpu/serving_mixed.py, issue 36: 32 streams decode while a
#       7,000-token prompt arrives every second, 8 of them; the streams' inter-token gaps with
#       and without the long prompts and the long ones' TTFT; prefill chunks of 512 tokens,
#       then whole prompts)
#   bash examples/h200_bench.sh OUTDIR mixed-2048 cost-plain cost-penalties cost-logprobs
#       (mixed-N: `mixed` with a prefill budget of N tokens; cost-*: the features' GPU cost,
#       spec at batch 1 and 32 greedy, plain / penalties + logit_bias / logprobs 5)
#   bash examples/h200_bench.sh OUTDIR cpu-overlap
#       (overlap on / off on two of the host's CPU cores: examples/cpu/overlap_figures.sh)
# BASE=DIR runs every phase side by side: first in DIR (a checkout of the commit to compare
# with, its own examples/h200_bench.sh and synthetic pairs in $SYN-base), then here; the
# results go to OUTDIR/base and OUTDIR/head. E.g. the last commit, on the device machine:
#   git archive HEAD~1 | tar -x -C .old/base   # here, with /.old/ in .git/info/exclude
#   BASE=.old/base REPEATS=2 bash examples/h200_bench.sh OUT batch16 prompt-2048
# The experiments behind the defaults (kernel microbenchmarks, in-process A/B of step
# settings) are in lab/h200_lab.sh.
# Each phase writes OUTDIR/<phase>.json (and .log); synthetic pairs are kept in $SYN.
# EXTRA="--no-cuda-graphs" (say) is added to every bench command; each figure is the median
# of REPEATS timed runs (default 3) after one warm-up run. The bench phases run with prefix
# caching off (tandem bench's default), as commits before the paged KV cache did.
set -u
OUT=${1:?usage: h200_bench.sh OUTDIR PHASE...}; shift
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
SYN=${SYN:-/tmp/tandem-syn}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
PENALTIES='{"repetition_penalty": 1.1, "frequency_penalty": 0.2, "presence_penalty": 0.1, "logit_bias": {"5": 1.0, "17": -2.0}}'
if [ -n "${BASE:-}" ]; then   # side by side, phase by phase: BASE's tree first, then this one
    here=$(pwd)
    for phase in "$@"; do
        echo "=== base: $BASE"
        (cd "$BASE" && BASE= SYN="$SYN-base" bash examples/h200_bench.sh "$OUT/base" "$phase")
        echo "=== head: $here"
        BASE= bash examples/h200_bench.sh "$OUT/head" "$phase"
    done
    exit 0
fi
bench() {   # bench PHASE ARGS...: a synthetic pair (8b unless --synthetic follows), bf16,
            # 128-token prompts, 256 new tokens
    local phase=$1; shift
    local start=$SECONDS
    python -m launcher bench --synthetic 8b --device cuda:0 --dtype bfloat16 \
        --prompt-len 128 --new-tokens 256 --synthetic-dir "$SYN" --out "$OUT/$phase.json" \
        --repeats "${REPEATS:-3}" ${EXTRA:-} "$@" > "$OUT/$phase.log" 2>&1
    echo "== $phase (rc $?, $((SECONDS - start)) s)"; grep '^|' "$OUT/$phase.log"
}
serving() {   # serving SCRIPT PHASE ARGS...: the serving experiment SCRIPT of examples/gpu
              # (serving_kv, serving_mixed), 8b bf16 unless ARGS say
    local script=$1 phase=$2; shift 2
    local start=$SECONDS
    python "examples/gpu/$script.py" --device cuda:0 --synthetic-dir "$SYN" \
        --out "$OUT/$phase.json" "$@" > "$OUT/$phase.log" 2>&1
    echo "== $phase (rc $?, $((SECONDS - start)) s)"; grep '^|' "$OUT/$phase.log"
}
for phase in "$@"; do
    case $phase in
        check) python examples/gpu/graphs_check.py --shape 1b --out "$OUT/check.json" \
                   > "$OUT/check.log" 2>&1; echo "== check (rc $?)"; tail -20 "$OUT/check.log" ;;
        profile-fp8-70b) python examples/gpu/profile_forward.py --shape 70b --quantization fp8 \
                             --tokens 1 5 --slots 1 --out "$OUT/profile-fp8-70b.json" \
                             > "$OUT/profile-fp8-70b.log" 2>&1
                         echo "== profile-fp8-70b (rc $?)"; grep -A14 "^==" "$OUT/profile-fp8-70b.log" ;;
        profile-fp8) python examples/gpu/profile_forward.py --shape 8b --quantization fp8 \
                         --tokens 1 5 --slots 1 --out "$OUT/profile-fp8.json" \
                         > "$OUT/profile-fp8.log" 2>&1
                     echo "== profile-fp8 (rc $?)"; grep -A14 "^==" "$OUT/profile-fp8.log" ;;
        fp8-check) python examples/gpu/fp8_check.py --shape 8b --out "$OUT/fp8-check.json" \
                       > "$OUT/fp8-check.log" 2>&1; echo "== fp8-check (rc $?)"
                   tail -15 "$OUT/fp8-check.log" ;;
        fp8-auto-*) bench "$phase" --quantization fp8 --batch-sizes 1 --eps "${phase#fp8-auto-}" \
                        --draft-len auto --modes target,spec ;;
        fp8-70b-*) bench "$phase" --synthetic 70b --quantization fp8 --batch-sizes 1 \
                       --eps "${phase#fp8-70b-}" --draft-len auto --modes target,spec ;;
        k4) bench k4 --batch-sizes 1 --eps 0.02 --draft-len 4 ${K4_MODES:-} ;;
        auto-0.02) bench auto-0.02 --batch-sizes 1 --eps 0.02 --draft-len auto \
                       --modes target,spec ;;
        family-*) bench "$phase" --synthetic "${phase#family-}" --batch-sizes 1 --eps 0.02 \
                      --draft-len auto --modes target,spec ;;
        eps-0.05) bench eps-0.05 --batch-sizes 1 --eps 0.05 --draft-len 4 \
                      --modes target,spec,hf-assisted ;;
        auto-0.2) bench auto-0.2 --batch-sizes 1 --eps 0.2 --draft-len auto --modes target,spec ;;
        batch16) bench batch16 --batch-sizes 1,16 --eps 0.02 --draft-len 4 --modes target,spec ;;
        tp2-smoke) bench tp2-smoke --synthetic 1b --target-tp 2 --new-tokens 64 --eps 0.02 \
                       --draft-len 4 --modes target,spec ;;
        70b-*) bench "$phase" --synthetic 70b --target-tp 2 --batch-sizes 1 \
                   --eps "${phase#70b-}" --draft-len "${K70:-4}" --modes target,spec ;;
        profile) python examples/gpu/profile_forward.py --shape 8b --tokens 1 5 --slots 1 16 --gemm \
                     --out "$OUT/profile.json" > "$OUT/profile.log" 2>&1
                 echo "== profile (rc $?)"; grep -A8 "^==" "$OUT/profile.log"
                 grep "^gemm\|^copy" "$OUT/profile.log" ;;
        spec-profile) TANDEM_PROFILE=1 bench spec-profile --batch-sizes 1 --eps 0.02 \
                          --draft-len 4 --modes spec ;;   # phases: spec_server_stats.profile
        k[0-9]*) bench "$phase" --batch-sizes 1 --eps 0.02 --draft-len "${phase#k}" \
                     --modes spec ;;
        prompt-*) bench "$phase" --batch-sizes 1 --eps 0.02 --draft-len auto \
                      --prompt-len "${phase#prompt-}" --modes target,spec ;;
        decode-*) bench "$phase" --batch-sizes 1 --eps 0.02 --prompt-len "${phase#decode-}" \
                      --modes target ;;
        trt-70b) bench trt-70b --synthetic 70b --quantization fp8 --batch-sizes 1 --eps 0.01 \
                     --draft-len auto --prompt-len 500 --new-tokens 200 --modes target,spec ;;
        kv-ttft) serving serving_kv kv-ttft ttft --prompt-len 2000 --suffix-len 50 --runs 5 ;;
        kv-serve64) serving serving_kv kv-serve64 serve --concurrency 64 --prompt-len 128 \
                        --new-tokens 256 ;;
        kv-serve256) serving serving_kv kv-serve256 serve --concurrency 256 --prompt-len 2000 \
                         --new-tokens 256 --max-seq-len 32768 ;;
        kv-70b) serving serving_kv kv-70b serve --synthetic 70b --quantization fp8 --eps 0.01 \
                    --concurrency 64 --prompt-len 2000 --new-tokens 256 --max-seq-len 32768 ;;
        kv-fp8) serving serving_kv kv-fp8 kvdtype --kv-dtypes auto,fp8 --concurrency 8 --prompt-len 8000 \
                    --new-tokens 128 ;;
        mixed) serving serving_mixed mixed --streams 32 --long-prompt-len 7000 --long-every 1.0 \
                   --long-count 8 --max-prefill-tokens 512 ;;
        mixed-whole) serving serving_mixed mixed-whole --streams 32 --long-prompt-len 7000 --long-every 1.0 \
                         --long-count 8 --max-prefill-tokens none ;;
        mixed-[0-9]*) serving serving_mixed "$phase" --streams 32 --long-prompt-len 7000 \
                          --long-every 1.0 --long-count 8 --max-prefill-tokens "${phase#mixed-}" ;;
        cost-plain) bench cost-plain --batch-sizes 1,32 --eps 0.02 --draft-len auto --modes spec ;;
        cost-penalties) bench cost-penalties --batch-sizes 1,32 --eps 0.02 --draft-len auto \
                            --modes spec --sampling "$PENALTIES" ;;
        cost-logprobs) bench cost-logprobs --batch-sizes 1,32 --eps 0.02 --draft-len auto \
                           --modes spec --sampling '{"logprobs": 5}' ;;
        cpu-overlap) CORES=${CORES:-0,1} bash examples/cpu/overlap_figures.sh "$OUT/cpu-overlap" ;;
        *) echo "unknown phase $phase"; exit 2 ;;
    esac
done
