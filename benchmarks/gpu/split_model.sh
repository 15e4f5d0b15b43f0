#!/usr/bin/env bash
# CPU machine, once: the trained model's GGUF in parts that fit one device call each
# (64 MiB per call with the working tree, which is ~4 MB), as .carry/m/part00..part19.
# usage: bash benchmarks/gpu/split_model.sh WORKDIR   (WORKDIR of prepare_models.sh, after
#        `prepare_models.sh WORKDIR qwen2.5-coder-1.5b` joined and checked the GGUF)
set -euo pipefail
gguf=$1/wheels/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf
rm -rf .carry/m && mkdir -p .carry/m
split -b 56M -d -a 2 "$gguf" .carry/m/part
ls .carry/m
