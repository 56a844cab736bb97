#!/usr/bin/env bash
# The protocol's step 3 (issue 48; docs/research/dispatch.md, "Commands"), one cell at a time,
# with every run's results.csv and each matrix's matrix.json copied here and committed after
# each cell, so a lost machine loses at most one cell. Run from the repository root:
#   bash docs/results/protocol-48-full/run.sh        (resumes: finished runs are read, not rerun)
#   bash docs/results/protocol-48-full/run.sh "8 instances s0" "8 instances s1" ...   (those cells only)
# A cell's tolerance needs its group's lowest seed (the chaos floor) and every seed run (the seed
# spread), so a list of cells names whole groups. The runs of the first 28 cells of 2026-12-06
# were not kept (the repository's `runs/` ignore rule kept them out of the commits, until this
# folder's .gitignore let them in); their tables are in docs/research/dispatch.md.
set -u
cd "$(git rev-parse --show-toplevel)"
HERE=docs/results/protocol-48-full
R='from stack.dispatch import ROUTER_DISPATCH as R, DispatchSpec as S; import sys'
spec() { python -c "$R; print('smetric-global+' + S.parse(sys.argv[1], base=R).label())" "$1"; }
C0=$(spec deadline-defer)
C1=$(spec deadline-defer:lead_queue=1:lead_share=inf)
C2=$(spec deadline-defer:age_k=inf:far_k=5)
mkdir -p out/p48
# take in the screen's runs (C0 and C2 unchanged: the same runs), then this stage's own
for c in C0 C2; do
    [ -d out/p48/$c-full ] || { mkdir -p out/p48/$c-full && cp -r docs/results/protocol-48-screen/$c-screen/. out/p48/$c-full/; }
done
[ -d $HERE/runs ] && cp -rn $HERE/runs/. out/p48/
# C1r first on the screen's cells (H200 first: the cell the revision is for), then the new seeds
CELLS=("H200 s0" "agentic s0" "agentic s1" "agentic s2" "4 replicas s0" "8M shared NIC s0"
    "200k shared NIC s0" "tight SLO s0" "loose fixed budget s0" "loose per-token budget s0"
    "8 instances s0" "mooncake conversation s0" "mooncake synthetic s0" "64 instances s0"
    "H200 s1" "H200 s2" "agentic s3" "agentic s4" "agentic s5" "4 replicas s1" "4 replicas s2"
    "8M shared NIC s1" "8M shared NIC s2" "200k shared NIC s1" "200k shared NIC s2"
    "tight SLO s1" "tight SLO s2" "loose fixed budget s1" "loose fixed budget s2"
    "loose per-token budget s1" "loose per-token budget s2" "8 instances s1" "8 instances s2"
    "64 instances s1" "64 instances s2")
[ $# -gt 0 ] && CELLS=("$@")
SEL=""
for cell in "${CELLS[@]}"; do
    SEL="${SEL:+$SEL,}$cell"
    for c in C0 C1 C2; do
        t0=$(date +%s)
        extra=()
        [ $c = C0 ] || extra=(--baselines-from out/p48/C0-full)
        name=$c; [ $c = C1 ] && name=C1r
        python benchmarks/dispatch_matrix.py --matrix protocol --stage full --clients --cells "$SEL" \
            --candidate "${!c}" --jobs 2 "${extra[@]}" --out out/p48/$name-full \
            > out/p48/$name-full.log 2>&1
        rc=$?
        echo "$(date -u +%H:%M:%S) $cell $name rc=$rc $(( $(date +%s) - t0 ))s" >> $HERE/runner.log
    done
    find out/p48/C0-full out/p48/C1r-full out/p48/C2-full \( -name results.csv -o -name matrix.json \) \
        | while read -r f; do install -D -m 644 "$f" "$HERE/runs/${f#out/p48/}"; done
    git add $HERE && git commit -q -m "issue 48 full stage: results through '$cell' (C0, C1r, C2; $HERE)" -- $HERE
done
echo "$(date -u +%H:%M:%S) done" >> $HERE/runner.log
