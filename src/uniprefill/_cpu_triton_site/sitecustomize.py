# Put on PYTHONPATH by uniprefill.cpu_triton.enable(): vLLM's spawned processes run
# the V2 runner's Triton kernels through Triton's interpreter too.
import os

if os.environ.get("UNIPREFILL_CPU_TRITON_INTERPRETER") == "1":
    from uniprefill.cpu_triton import _patch_process

    _patch_process()
