#!/usr/bin/env bash
# The H200 measurements in README.md ("GPU performance"), phase by phase:
#   bash examples/h200_bench.sh OUTDIR check k4 auto-0.02 eps-0.05 auto-0.2 batch16
#   bash examples/h200_bench.sh OUTDIR tp2-smoke 70b-0.01      # two H200s: target TP 2
#   bash examples/h200_bench.sh OUTDIR profile spec-profile    # where the time goes
#   bash examples/h200_bench.sh OUTDIR kernels triton-off fp8-check fp8-auto-0.02 fp8-70b-0.0125
#       (the Triton attention kernel against the fused-torch path, FP8 8b and 70b on one GPU)
#   bash examples/h200_bench.sh OUTDIR auto-0.02 prefill-off fp8-auto-0.02 fp8-unfused chunk-64
#       (A/B: prefill graphs off, FP8 without its fused neighbours, attention KV chunks of 64)
#   bash examples/h200_bench.sh OUTDIR gemv profile-fp8 profile-fp8-70b
#       (a Triton small-M linear against cuBLAS / _scaled_mm per shape; the FP8 steps' kernels)
#   bash examples/h200_bench.sh OUTDIR gemm-layout
#       (the decode GEMMs as x @ W^T against W @ x^T, cold weights against weights in L2)
#   bash examples/h200_bench.sh OUTDIR cpu-overlap
#       (overlap on / off on two of the host's CPU cores: examples/cpu/overlap_figures.sh)
#   bash examples/h200_bench.sh OUTDIR nopdl-profile-fp8 profile-fp8 \
#       nopdl-fp8-auto-0.02 fp8-auto-0.02
#       (nopdl-PHASE: PHASE without programmatic dependent launch, into OUTDIR/nopdl;
#        nofold-PHASE: RoPE never folded into the attention kernel, into OUTDIR/nofold)
#   bash examples/h200_bench.sh OUTDIR step-ab workspace-ab
#       (cuBLAS against cuBLASLt with and without split-K on the 8b steps, bf16 and FP8, batch
#        1 and 16: examples/gpu/step_ab.py; the 8b bf16, 8b FP8 and 70b FP8 steps with and
#        without a cuBLAS / cuBLASLt workspace, runtime.models.loading.loader.no_gemm_workspace)
#   bash examples/h200_bench.sh OUTDIR silu-quant
#       (an experiment: SiLU·up + FP8 quantize in one launch against the compiled pieces)
#   bash examples/h200_bench.sh OUTDIR fold-ab fold-short fold-kernels
#       (RoPE and the KV write folded into the attention kernel against their own kernel:
#        the 8b decode and verify steps, bf16 and FP8, batch 1 and 16, step_ab.py;
#        fold-short: steps of 1, 2, 3 and 9 tokens at batch 1, folded from 2 and from 1 on;
#        fold-kernels: the two kernels against the folded one alone, examples/gpu/fold_bench.py)
#   bash examples/h200_bench.sh OUTDIR l2-ab l2-fp8-auto-0.02 fp8-auto-0.02
#       (each GEMM's weights read into L2 ahead of it on a side stream against not:
#        l2-ab: the 8b decode and verify steps, FP8 and bf16, step_ab.py's l2* modes;
#        l2-PHASE: PHASE with TANDEM_L2_PREFETCH=1, into OUTDIR/l2; l2v-PHASE: with
#        TANDEM_L2_PREFETCH=verify, steps of 2 or more tokens a row only, into OUTDIR/l2v)
#   bash examples/h200_bench.sh OUTDIR cdt-ab
#       (the compiled pieces with inductor's coordinate-descent tuning against without: the
#        8b steps, FP8 and bf16, step_ab.py's cdt modes; not kept, docs/benchmarks.md)
# Each phase writes OUTDIR/<phase>.json (and .log); synthetic pairs are kept in $SYN.
# EXTRA="--no-cuda-graphs" (say) is added to every bench command; each figure is the median
# of REPEATS timed runs (default 3) after one warm-up run.
set -u
OUT=${1:?usage: h200_bench.sh OUTDIR PHASE...}; shift
mkdir -p "$OUT"
SYN=${SYN:-/tmp/tandem-syn}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
bench() {   # bench PHASE ARGS...: a synthetic pair (8b unless --synthetic follows), bf16,
            # 128-token prompts, 256 new tokens
    local phase=$1; shift
    local start=$SECONDS
    python -m launcher bench --synthetic 8b --device cuda:0 --dtype bfloat16 \
        --prompt-len 128 --new-tokens 256 --synthetic-dir "$SYN" --out "$OUT/$phase.json" \
        --repeats "${REPEATS:-3}" ${EXTRA:-} "$@" > "$OUT/$phase.log" 2>&1
    echo "== $phase (rc $?, $((SECONDS - start)) s)"; grep '^|' "$OUT/$phase.log"
}
step_ab_set() {   # step_ab_set PHASE MODES TOKENS ARGS...: step_ab.py (8b, $R rounds) once
                  # per ARGS, into OUTDIR/PHASE-1.json, -2, ...
    local phase=$1 modes=$2 tokens=$3 i=0 args; shift 3
    for args in "$@"; do
        i=$((i + 1))
        python examples/gpu/step_ab.py --shape 8b --modes $modes --tokens $tokens \
            --rounds "$R" $args --out "$OUT/$phase-$i.json" > "$OUT/$phase-$i.log" 2>&1
        echo "== $phase $args (rc $?)"; grep "^==\|^largest" "$OUT/$phase-$i.log"
    done
}
for phase in "$@"; do
    case $phase in
        check) python examples/gpu/graphs_check.py --shape 1b --out "$OUT/check.json" \
                   > "$OUT/check.log" 2>&1; echo "== check (rc $?)"; tail -20 "$OUT/check.log" ;;
        kernels) python examples/gpu/kernel_bench.py --chunks "${CHUNKS:-0,256,64}" --out "$OUT/kernels.json" \
                     > "$OUT/kernels.log" 2>&1; echo "== kernels (rc $?)"; cat "$OUT/kernels.log" ;;
        triton-off) TANDEM_TRITON=0 bench triton-off --batch-sizes 1 --eps 0.02 \
                        --draft-len auto --modes target,spec ;;   # the fused-torch attention
        gemv) python examples/gpu/gemv_bench.py --out "$OUT/gemv.json" > "$OUT/gemv.log" 2>&1
              echo "== gemv (rc $?)"; cat "$OUT/gemv.log" ;;
        gemm-layout) python examples/gpu/gemm_layout_bench.py --out "$OUT/gemm-layout.json" \
                         > "$OUT/gemm-layout.log" 2>&1
                     echo "== gemm-layout (rc $?)"; cat "$OUT/gemm-layout.log" ;;
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
        prefill-off) TANDEM_PREFILL_GRAPHS=0 bench prefill-off --batch-sizes 1 --eps 0.02 \
                         --draft-len auto --modes target,spec ;;   # prompts eagerly, own shape
        fp8-unfused) TANDEM_FP8_FUSE=0 bench fp8-unfused --quantization fp8 --batch-sizes 1 \
                         --eps 0.02 --draft-len auto --modes target,spec ;;
        chunk-*) TANDEM_ATTN_CHUNK="${phase#chunk-}" bench "$phase" --batch-sizes 1 --eps 0.02 \
                     --draft-len auto --modes target,spec ;;
        fp8-auto-*) bench "$phase" --quantization fp8 --batch-sizes 1 --eps "${phase#fp8-auto-}" \
                        --draft-len auto --modes target,spec ;;
        fp8-70b-*) bench "$phase" --synthetic 70b --quantization fp8 --batch-sizes 1 \
                       --eps "${phase#fp8-70b-}" --draft-len auto --modes target,spec ;;
        k4) bench k4 --batch-sizes 1 --eps 0.02 --draft-len 4 ${K4_MODES:-} ;;
        auto-0.02) bench auto-0.02 --batch-sizes 1 --eps 0.02 --draft-len auto \
                       --modes target,spec ;;
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
        nopdl-*) TANDEM_PDL=0 bash "$0" "$OUT/nopdl" "${phase#nopdl-}"
                 ;;
        nofold-*) TANDEM_FOLD_ROPE=0 bash "$0" "$OUT/nofold" "${phase#nofold-}"
                  ;;
        l2-ab) R=${ROUNDS:-2} step_ab_set l2-ab "${L2_MODES:-pdl l2-attn l2 l2-all l2-wide}" \
                   "1 5" "--quantization fp8" "" ;;
        l2-*) TANDEM_L2_PREFETCH=1 bash "$0" "$OUT/l2" "${phase#l2-}"
              ;;
        cdt-ab) R=${ROUNDS:-2} step_ab_set cdt-ab "${CDT_MODES:-pdl cdt cdt-all}" "1 5" \
                    "--quantization fp8" "" ;;
        l2v-*) TANDEM_L2_PREFETCH=verify bash "$0" "$OUT/l2v" "${phase#l2v-}"
               ;;
        workspace-ab)   # "with": torch's cuBLAS default and a large cuBLASLt one
            for args in "--shape 8b" "--shape 8b --quantization fp8" \
                        "--shape 70b --quantization fp8"; do
                for ws in with without with without; do
                    vars="CUBLAS_WORKSPACE_CONFIG=:4096:8 CUBLASLT_WORKSPACE_SIZE=131072"
                    [ $ws = with ] || vars="CUBLAS_WORKSPACE_CONFIG=:0:0 CUBLASLT_WORKSPACE_SIZE=0"
                    env $vars python examples/gpu/step_ab.py $args --modes pdl \
                        --rounds 1 > "$OUT/workspace-ab.log" 2>&1
                    echo "== workspace-ab $args, $ws a workspace (rc $?)"
                    grep "^==" "$OUT/workspace-ab.log"
                done
            done ;;
        step-ab) R=${ROUNDS:-3} step_ab_set step-ab "pdl lt lt-nosplitk" "1 5" "" \
                     "--quantization fp8" "--batch 16" "--batch 16 --quantization fp8" ;;
        fold-ab) R=${ROUNDS:-2} step_ab_set fold-ab "nofold pdl" "1 5" "" "--quantization fp8" \
                     "--batch 16" "--batch 16 --quantization fp8" ;;
        fold-short) R=${ROUNDS:-2} step_ab_set fold-short "nofold pdl foldall" "1 2 3 9" "" \
                        "--quantization fp8" ;;   # where folding starts to pay
        fold-kernels) python examples/gpu/fold_bench.py --out "$OUT/fold-kernels.json" \
                          > "$OUT/fold-kernels.log" 2>&1
                      echo "== fold-kernels (rc $?)"; cat "$OUT/fold-kernels.log" ;;
        silu-quant) python examples/gpu/silu_quant_kernel.py > "$OUT/silu-quant.log" 2>&1
                    echo "== silu-quant (rc $?)"; cat "$OUT/silu-quant.log" ;;
        cpu-overlap) CORES=${CORES:-0,1} bash examples/cpu/overlap_figures.sh "$OUT/cpu-overlap" ;;
        *) echo "unknown phase $phase"; exit 2 ;;
    esac
done
