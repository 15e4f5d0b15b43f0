#!/usr/bin/env bash
# `uniprefill calibrate` on the trained model (after prepare_model.sh), one engine per
# prompt length, each JSON written after every pass to $OUT and /root/cal (kept for the
# lease's later calls).
# usage: bash benchmarks/gpu/calibrate_own.sh SECONDS SAMPLES LENGTH [LENGTH...]
#   SECONDS: the whole call's deadline (a length not finished by then keeps its passes)
#   env TOP_P (default 0.9,0.95,0.98,0.99,0.995,0.999), TASKS (default: the filler
#   suite and the two real-text tasks), TAG (file name suffix), SCHEDULES (drop schedules
#   to compare, space-separated, e.g. "6,10,13,17,20,24 4,8,12,16,20,24": one engine each)
set -uo pipefail
cd "$(dirname "$0")/../.."
. benchmarks/gpu/env.sh
deadline=$(( $(date +%s) + $1 )); samples=$2; shift 2
tasks=${TASKS:-niah_single,niah_multikey,niah_multivalue,vt,cwe,prose_fact,prose_2hop}
mkdir -p /root/cal
sched=(); for s in ${SCHEDULES:-}; do sched+=(--schedule "$s"); done
for len in "$@"; do
  left=$(( deadline - $(date +%s) ))
  (( left > 60 )) || { echo "no time left for $len"; break; }
  json=/root/cal/qwen2.5-coder-1.5b-$len${TAG:-}-gpu-calibrate.json
  timeout "$left" python3 -m uniprefill.cli calibrate "${MODEL:-/root/models/qwen2.5-coder-1.5b}" \
    --lengths "$len" --samples "$samples" --tasks "$tasks" \
    --top-p "${TOP_P:-0.9,0.95,0.98,0.99,0.995,0.999}" --no-progress --json "$json" "${sched[@]}" \
    2>&1 | grep -v -E "INFO|WARNING|it/s\]" | tail -n 40
  cp "$json" "$OUT/" 2>/dev/null
done
