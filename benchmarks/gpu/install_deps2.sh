#!/usr/bin/env bash
# Device call 6 (carry=[".carry/deps2"]): xgrammar + pydantic-extra-types (45 MB; vLLM 0.26
# imports xgrammar when vllm.LLM is first touched, even with no structured output).
set -euo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site2 .carry/deps2/*.whl
ls /tmp/site2
