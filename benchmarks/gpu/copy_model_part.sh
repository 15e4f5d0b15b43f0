#!/usr/bin/env bash
# The trained model's GGUF (Qwen2.5-Coder-1.5B, 1.1 GB) travels in 56 MiB parts (20), one per
# device call: carry=[".carry/m/partNN"], then `bash benchmarks/gpu/copy_model_part.sh NN`.
# Made on the CPU machine by benchmarks/gpu/split_model.sh.
set -euo pipefail
mkdir -p /root/mparts
cp ".carry/m/part$1" /root/mparts/
echo "$(ls /root/mparts | wc -l) parts: $(du -sh /root/mparts | cut -f1)"
