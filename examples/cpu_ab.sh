#!/usr/bin/env bash
# The tiny synthetic pair on the CPU at REV and at the working tree, side by side:
#   bash examples/cpu_ab.sh REV [PAIRS] [-- BENCH ARGS...]
# e.g. bash examples/cpu_ab.sh 347b2dd 3
# REV is checked out in a temporary git worktree (removed afterwards); each of PAIRS
# (default 3) alternations runs `tandem bench` there, then here, with the same arguments
# (default: --modes target,spec --batch-sizes 1,8 --new-tokens 32 --prompt-len 32
# --repeats 3), so both see the same host load; the table's last lines are the median of
# each row's tokens/s and TTFT over the pairs. On a 2-core host runs differ by 10-30%:
# trust a difference only when every pair shows it (the pairs are printed too).
set -euo pipefail
REV=${1:?usage: cpu_ab.sh REV [PAIRS] [-- BENCH ARGS...]}; shift
PAIRS=3
if [ $# -gt 0 ] && [ "$1" != "--" ]; then PAIRS=$1; shift; fi
[ $# -gt 0 ] && [ "$1" = "--" ] && shift
ARGS=("$@")
[ ${#ARGS[@]} -eq 0 ] && ARGS=(--modes target,spec --batch-sizes 1,8 --new-tokens 32
                               --prompt-len 32 --repeats 3)
HERE=$(git rev-parse --show-toplevel)
BASE=$(mktemp -d /tmp/tandem-ab.XXXXXX)
OUT=$(mktemp -d /tmp/tandem-ab-out.XXXXXX)
cleanup() { git -C "$HERE" worktree remove --force "$BASE" >/dev/null 2>&1 || rm -rf "$BASE"; }
trap cleanup EXIT
git -C "$HERE" worktree add --detach "$BASE" "$REV" >/dev/null
run() {   # run TREE LABEL PAIR: one bench at TREE, its table rows tagged with LABEL
    (cd "$1" && python -m launcher bench --synthetic tiny --device cpu "${ARGS[@]}" \
        --out "$OUT/$2-$3.json" 2>/dev/null | grep '^| [a-z]' | grep -v '^| mode' \
        | sed "s/^/$2 /")
}
for pair in $(seq "$PAIRS"); do
    echo "== pair $pair"
    run "$BASE" "$REV" "$pair"
    run "$HERE" HEAD "$pair"
done
python - "$OUT" "$REV" <<'EOF'
import glob, json, statistics, sys
out, rev = sys.argv[1], sys.argv[2]
rows = {}
for label in (rev, "HEAD"):
    for path in sorted(glob.glob(f"{out}/{label}-*.json")):
        for r in json.load(open(path))["results"]:
            if r.get("tokens_per_s") is None:
                continue
            ttft = (r.get("time_to_first_token_s") or [None])[0]
            key = (r["mode"], r["batch_size"])
            rows.setdefault(key, {}).setdefault(label, []).append((r["tokens_per_s"], ttft))
print(f"| mode | batch | {rev} tokens/s | HEAD tokens/s | {rev} TTFT ms | HEAD TTFT ms |")
print("|---|---|---|---|---|---|")
for (mode, batch), by in sorted(rows.items()):
    cells = []
    for i in (0, 1):
        for label in (rev, "HEAD"):
            vals = [v[i] for v in by.get(label, []) if v[i] is not None]
            med = statistics.median(vals) if vals else None
            cells.append("-" if med is None else f"{med:.1f}" if i == 0 else f"{1000 * med:.1f}")
    print(f"| {mode} | {batch} | " + " | ".join(cells) + " |")
EOF
rm -rf "$OUT"
