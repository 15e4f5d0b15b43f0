#!/usr/bin/env bash
# The accuracy runs behind docs/accuracy.md, one length per invocation so each result
# lands on its own. Run in the WORKDIR given to prepare_models.sh. About 4.5 hours on
# 2 CPU cores (Gemma 3 270M: 4K 20 min, 8K 28 min, 16K 42 min, 32K 47 min; SmolLM2-135M:
# 4K 12 min, 8K 28 min; ablations 12 min at 4K, 30 min at 8K).
# Results: results/*.json; summarise with
#   uniprefill report results/*.json --by model,length
set -euo pipefail
export HF_HUB_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=4
mkdir -p results
run() { # model, tag, then eval args
  model=$1 tag=$2; shift 2
  uniprefill eval "models/$model" --dtype bfloat16 --progress \
      --json "results/$model-$tag.json" "$@"
}
run gemma3-270m 4k  --top-p 0.98 --lengths 4k  --samples 10
run gemma3-270m 8k  --top-p 0.98 --lengths 8k  --samples 10
run gemma3-270m 16k --top-p 0.98 --lengths 16k --samples 6
run gemma3-270m 32k --top-p 0.98 --lengths 32512 --samples 4 \
    --tasks niah_single,niah_multikey,niah_multivalue,vt
run smollm2-135m 4k   --top-p 0.99 --lengths 4k   --samples 10
run smollm2-135m 8000 --top-p 0.99 --lengths 8000 --samples 10
# ablations of the default six-layer Llama schedule
run smollm2-135m 4k-l14-22 --top-p 0.99 --drop-layers 14,22 --lengths 4k --samples 10
run smollm2-135m 4k-p0999  --top-p 0.999 --lengths 4k --samples 10
run smollm2-135m 8000-p0999 --top-p 0.999 --lengths 8000 --samples 10
# an earlier drop layer on Gemma 3 (the default schedule uses layer 11 only)
run gemma3-270m 8k-l5-11 --top-p 0.98 --drop-layers 5,11 --lengths 8k --samples 10
