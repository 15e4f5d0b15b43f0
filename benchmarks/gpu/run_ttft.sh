#!/usr/bin/env bash
# Device call 7 and later: run benchmarks/bench_ttft.py (or the script given first) with
# the given arguments, after env.sh's set-up.
# usage (carry=[".carry/deps", ".carry/deps3"] the first time; nothing later):
#   bash benchmarks/gpu/run_ttft.sh --models llama8b --lengths 8K,32K ...
#   bash benchmarks/gpu/run_ttft.sh benchmarks/bench_serving.py --model llama8b   (any script)
set -uo pipefail
cd "$(dirname "$0")/../.."
. benchmarks/gpu/env.sh
script=benchmarks/bench_ttft.py
if [[ "${1:-}" == *.py ]]; then script=$1; shift; fi
python3 "$script" --out "$OUT" "$@" 2>&1 | tee "$OUT/run.log"
exit "${PIPESTATUS[0]}"
