#!/usr/bin/env bash
# Issue 48, after the protocol's full stage: the three 4-replica cells again, with the router
# replicas sharing one memory of the requests refused for their wait (stack/dispatch/refusals.py;
# docs/research/dispatch.md, "After the full stage: the replicas share their refusals").
# The shipped default (C1r) with the baselines, then C0 and C2 on those baselines, then C1r's
# seed-0 cell once more (a reproduction). About 30 min on 2 cores. From the repository root:
#   bash docs/results/protocol-48-replicas/run.sh
set -u
cd "$(git rev-parse --show-toplevel)"
HERE=docs/results/protocol-48-replicas
OUT=out/p48s
C1r="smetric-global+$(python -c 'from stack.dispatch import ROUTER_DISPATCH as R; print(R.label())')"
# C0 and C2 exactly as the full stage ran them (its matrix.json's candidate)
C0='smetric-global+deadline-defer:T=4:affinity=1:age_k=1.5:aged_share=0.125:bypass=1:far_k=5:lead_share=1:max_queue_wait_s=30:max_wait_k=5:slo_k=0.5'
C2='smetric-global+deadline-defer:T=4:affinity=1:age_k=inf:aged_share=0.125:bypass=1:far_k=5:lead_share=1:max_queue_wait_s=30:max_wait_k=5:slo_k=0.5'
CELLS="4 replicas s0,4 replicas s1,4 replicas s2"
M=(python benchmarks/dispatch_matrix.py --matrix protocol --stage full --clients --jobs 2)
mkdir -p $OUT
"${M[@]}" --cells "$CELLS" --candidate "$C1r" --out $OUT/shared > $OUT/shared.log 2>&1
for c in C0 C2; do
    "${M[@]}" --cells "$CELLS" --candidate "${!c}" --baselines-from $OUT/shared --out $OUT/$c > $OUT/$c.log 2>&1
done
"${M[@]}" --cells "4 replicas s0" --candidate "$C1r" --baselines-from $OUT/shared --out $OUT/C1r-again \
    > $OUT/C1r-again.log 2>&1
for d in shared C0 C2 C1r-again; do
    find $OUT/$d \( -name results.csv -o -name matrix.json \) \
        | while read -r f; do install -D -m 644 "$f" "$HERE/${f#$OUT/}"; done
done
