"""What a chunked prompt keeps from its earlier chunks until its last chunk scores it.

A prompt longer than one step's budget arrives in chunks. Its selection needs the
prompt's last ``last_q`` queries, which only the last chunk has, so earlier chunks
run only stage 0 (every layer up to the first drop layer's attention, whose KV they
write) and leave here what the last chunk needs to carry them on: per token the
hidden state and residual at the first gather point, its position, and the drop
layer's key; the queries of tokens among the prompt's last ``last_q`` too.

The store is bounded in tokens (``max_stash_tokens``): a prompt whose whole length
does not fit when its first chunk arrives runs dense, counted in the stats. Room
held by a prompt whose last chunk runs in the same step counts as free: that chunk
empties its stash at the step's first gather point. vLLM's scheduler starts the
next long prompt beside the last chunk of the one before, so prompts that follow
one another each find the whole room. In memory the stash then holds at most
the room plus one step's tokens (:func:`stash_reserve_bytes`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class StashedChunk:
    """One earlier chunk of a prompt, as stage 0 left it."""

    hidden: torch.Tensor  # [n, H]
    residual: torch.Tensor  # [n, H]
    positions: torch.Tensor  # [n]
    keys: torch.Tensor  # [n, Hkv, D] (this rank's heads)
    # Queries of this chunk's tokens that are among the prompt's last last_q: [m, Hq, D],
    # from the chunk's token tail_offset on (a recompute after a preemption holds
    # generated tokens after the prompt, so they need not be the chunk's last ones).
    tail_queries: torch.Tensor | None = None
    tail_offset: int = 0


@dataclass
class PromptStash:
    """The earlier chunks of one request, in order."""

    reserved: int  # tokens counted against the store (the whole prefill)
    chunks: list[StashedChunk] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.hidden.shape[0] for c in self.chunks)

    def cat(self, name: str) -> torch.Tensor:
        return torch.cat([getattr(c, name) for c in self.chunks])


class StashStore:
    """Per-request stashes, bounded by a token count that vLLM's memory profile holds."""

    def __init__(self, capacity_tokens: int) -> None:
        self.capacity = capacity_tokens
        self.used = 0
        self.by_slot: dict[int, PromptStash] = {}

    def __len__(self) -> int:
        """Open stashes (prompts whose earlier chunks are held)."""
        return len(self.by_slot)

    def __contains__(self, slot: int) -> bool:
        return slot in self.by_slot

    def open(self, slot: int, prompt_len: int) -> bool:
        """Reserve room for a prompt's chunks; ``False`` (nothing reserved) if it is full."""
        self.release(slot)
        if self.used + prompt_len > self.capacity:
            return False
        self.used += prompt_len
        self.by_slot[slot] = PromptStash(reserved=prompt_len)
        return True

    def get(self, slot: int) -> PromptStash:
        return self.by_slot[slot]

    def retire(self, slot: int) -> None:
        """Free a stash's room now; its chunks stay readable until ``release``.

        For a prompt whose last chunk runs this step: a prompt starting in the same
        step may take the room, and both fit in memory (see the module docstring).
        """
        stash = self.by_slot[slot]
        self.used -= stash.reserved
        stash.reserved = 0

    def release(self, slot: int) -> None:
        stash = self.by_slot.pop(slot, None)
        if stash is not None:
            self.used -= stash.reserved


def stash_reserve_bytes(
    capacity: int,
    max_tokens: int,
    hidden_size: int,
    act_bytes: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_size: int,
) -> int:
    """Device memory of a full stash plus the last chunk's extended copies (a bound).

    Per stashed token: hidden state, residual, key and position, for up to
    ``capacity + max_tokens`` tokens (prompts starting in the step of another's last
    chunk take its room while it is still read, see the module docstring). The last chunk
    builds, for the stash and its own tokens, one copy of hidden and residual (the
    gather source) and the scoring q/k.
    """
    per_token = 2 * hidden_size * act_bytes + num_kv_heads * head_size * act_bytes + 8
    ext = (capacity + max_tokens) * (
        2 * hidden_size * act_bytes + (num_q_heads + num_kv_heads) * head_size * act_bytes
    )
    return (capacity + max_tokens) * per_token + ext
