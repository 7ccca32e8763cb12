#!/usr/bin/env bash
# The experiments behind the runtime's defaults, on an H200 (not part of the product; the
# figures and what was kept: docs/benchmarks.md, docs/journal.md):
#   bash lab/h200_lab.sh OUTDIR kernels
#       (the Triton attention kernel against the eager path, KV chunks $CHUNKS:
#        lab/gpu/kernel_bench.py)
#   bash lab/h200_lab.sh OUTDIR gemv gemm-layout
#       (a Triton small-M linear against cuBLAS / _scaled_mm per shape; the decode GEMMs as
#        x @ W^T against W @ x^T, cold weights against weights in L2)
#   bash lab/h200_lab.sh OUTDIR step-ab workspace-ab
#       (cuBLAS against cuBLASLt with and without split-K on the 8b steps, bf16 and FP8, batch
#        1 and 16: lab/gpu/step_ab.py; the 8b bf16, 8b FP8 and 70b FP8 steps with and
#        without a cuBLAS / cuBLASLt workspace, runtime.models.loading.loader.no_gemm_workspace)
#   bash lab/h200_lab.sh OUTDIR silu-quant
#       (SiLU·up + FP8 quantize in one launch against the compiled pieces: not kept)
#   bash lab/h200_lab.sh OUTDIR fold-ab fold-short fold-kernels
#       (RoPE and the KV write folded into the attention kernel against their own kernel:
#        the 8b decode and verify steps, bf16 and FP8, batch 1 and 16, step_ab.py;
#        fold-short: steps of 1, 2, 3 and 9 tokens at batch 1, folded from 2 and from 1 on;
#        fold-kernels: the two kernels against the folded one alone, lab/gpu/fold_bench.py)
#   bash lab/h200_lab.sh OUTDIR cdt-ab
#       (the compiled pieces with inductor's coordinate-descent tuning against without: the
#        8b steps, FP8 and bf16, step_ab.py's cdt modes; not kept)
# Each phase writes OUTDIR/<phase>*.json (and .log). Run from the repository root.
set -u
OUT=${1:?usage: h200_lab.sh OUTDIR PHASE...}; shift
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
step_ab_set() {   # step_ab_set PHASE MODES TOKENS ARGS...: step_ab.py (8b, $R rounds) once
                  # per ARGS, into OUTDIR/PHASE-1.json, -2, ...
    local phase=$1 modes=$2 tokens=$3 i=0 args; shift 3
    for args in "$@"; do
        i=$((i + 1))
        python lab/gpu/step_ab.py --shape 8b --modes $modes --tokens $tokens \
            --rounds "$R" $args --out "$OUT/$phase-$i.json" > "$OUT/$phase-$i.log" 2>&1
        echo "== $phase $args (rc $?)"; grep "^==\|^largest" "$OUT/$phase-$i.log"
    done
}
for phase in "$@"; do
    case $phase in
        kernels) python lab/gpu/kernel_bench.py --chunks "${CHUNKS:-0,256,64}" --out "$OUT/kernels.json" \
                     > "$OUT/kernels.log" 2>&1; echo "== kernels (rc $?)"; cat "$OUT/kernels.log" ;;
        gemv) python lab/gpu/gemv_bench.py --out "$OUT/gemv.json" > "$OUT/gemv.log" 2>&1
              echo "== gemv (rc $?)"; cat "$OUT/gemv.log" ;;
        gemm-layout) python lab/gpu/gemm_layout_bench.py --out "$OUT/gemm-layout.json" \
                         > "$OUT/gemm-layout.log" 2>&1
                     echo "== gemm-layout (rc $?)"; cat "$OUT/gemm-layout.log" ;;
        cdt-ab) R=${ROUNDS:-2} step_ab_set cdt-ab "${CDT_MODES:-pdl cdt cdt-all}" "1 5" \
                    "--quantization fp8" "" ;;
        workspace-ab)   # "with": torch's cuBLAS default and a large cuBLASLt one
            for args in "--shape 8b" "--shape 8b --quantization fp8" \
                        "--shape 70b --quantization fp8"; do
                for ws in with without with without; do
                    vars="CUBLAS_WORKSPACE_CONFIG=:4096:8 CUBLASLT_WORKSPACE_SIZE=131072"
                    [ $ws = with ] || vars="CUBLAS_WORKSPACE_CONFIG=:0:0 CUBLASLT_WORKSPACE_SIZE=0"
                    env $vars python lab/gpu/step_ab.py $args --modes pdl \
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
        fold-kernels) python lab/gpu/fold_bench.py --out "$OUT/fold-kernels.json" \
                          > "$OUT/fold-kernels.log" 2>&1
                      echo "== fold-kernels (rc $?)"; cat "$OUT/fold-kernels.log" ;;
        silu-quant) python lab/gpu/silu_quant_kernel.py > "$OUT/silu-quant.log" 2>&1
                    echo "== silu-quant (rc $?)"; cat "$OUT/silu-quant.log" ;;
        *) echo "unknown phase $phase"; exit 2 ;;
    esac
done
