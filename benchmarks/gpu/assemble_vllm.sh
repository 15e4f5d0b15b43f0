#!/usr/bin/env bash
# Device call 5 (carry=[".carry/p4", ".carry/vllm.sha256"]): last part, join, check, unpack.
# vLLM goes to /tmp/site with pip --target (no deps: those come in call 6).
set -euo pipefail
cp .carry/p4/* /root/parts/
# Every part must be there (a failed copy call leaves a gap); the parts stay until the
# joined wheel checks out, so a missing one can be sent again without the others.
for n in 0 1 2 3 4; do
  [[ -f /root/parts/part$n ]] || { echo "part$n missing: send it again (copy_part.sh $n)"; exit 5; }
done
whl=/root/vllm-0.26.0-cp38-abi3-manylinux_2_28_x86_64.whl
cat /root/parts/part? > "$whl"
echo "$(cat .carry/vllm.sha256)  $whl" | sha256sum -c -
rm -f /root/parts/part?
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$whl"
rm -f "$whl"
du -sh /tmp/site
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"
