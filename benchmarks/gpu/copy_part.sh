#!/usr/bin/env bash
# Device call 1-4: stash one carried part of the vLLM 0.26.0 wheel on the device machine.
# usage (from the repo root, carry=[".carry/pN"]): bash benchmarks/gpu/copy_part.sh N
set -euo pipefail
n=$1
mkdir -p /root/parts
cp .carry/p"$n"/* /root/parts/
ls -l /root/parts
