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

import numpy as np
import torch

from uniprefill.vllm.step import ExtendedRows, StageWalk, query_start

# Tokens an earlier chunk keeps in each later stage: its KV and linear-attention state
# writes there are overwritten by the last chunk. Two, not one: a one-token row would
# pass for a decode, and vLLM's Mamba metadata wants decodes ahead of prefills.
PLACEHOLDER_TOKENS = 2


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


# ---- a step with chunked prompts, at the first drop layer (called by the runtime) ------------
def keep_chunk_keys(
    walk: StageWalk,
    q: torch.Tensor,
    k: torch.Tensor,
    qsl: np.ndarray,
    prompt_len: np.ndarray,
    last_q: int,
) -> None:
    """Keep each stashing row's drop-layer keys (and queries among the prompt's last
    ``last_q``) until its gather point completes the chunk; ``prompt_len`` per row."""
    for r in np.flatnonzero(walk.plan.stashing):
        a, b = int(qsl[r]), int(qsl[r + 1])
        prompt = int(prompt_len[r])
        # The scoring queries are the prompt's last last_q tokens; a recompute's
        # chunk may also hold generated tokens after them.
        c0 = int(walk.plan.ctx0[r])
        lo = max(c0, prompt - last_q) - c0
        hi = min(c0 + b - a, prompt) - c0
        tail = (lo, q[a + lo : a + hi].clone()) if hi > lo else None
        walk.chunk_keys[int(r)] = (k[a:b].clone(), tail)


def extended_scoring(
    store: StashStore, walk: StageWalk, q: torch.Tensor, k: torch.Tensor, qsl: np.ndarray
) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
    """q/k of every row, each last chunk's stashed tokens ahead of its own, and the rows'
    lengths; sets ``walk.extended``.

    Only a row's last ``last_q`` queries are scored; the other stashed query rows
    are zeros.
    """
    qs: list[torch.Tensor] = []
    ks: list[torch.Tensor] = []
    to_source: list[np.ndarray] = []
    slots: list[int] = []
    source_off = walk.num_tokens_padded
    for r in range(len(walk.qlen)):
        a, b = int(qsl[r]), int(qsl[r + 1])
        n_stash = int(walk.plan.stash_len[r])
        if n_stash:
            stash = store.get(int(walk.plan.slots[r]))
            stash_q = q.new_zeros((n_stash, *q.shape[1:]))
            offset = 0
            for c in stash.chunks:
                if c.tail_queries is not None:
                    at = offset + c.tail_offset
                    stash_q[at : at + c.tail_queries.shape[0]] = c.tail_queries
                offset += c.hidden.shape[0]
            qs.append(stash_q)
            ks.append(stash.cat("keys"))
            to_source.append(np.arange(source_off, source_off + n_stash))
            source_off += n_stash
            slots.append(int(walk.plan.slots[r]))
        qs.append(q[a:b])
        ks.append(k[a:b])
        to_source.append(np.arange(a, b))
    index = torch.from_numpy(np.concatenate(to_source).astype(np.int64))
    walk.extended = ExtendedRows(index.to(q.device, non_blocking=True), slots)
    return torch.cat(qs), torch.cat(ks), walk.plan.prefill_len


def stash_chunks(
    store: StashStore,
    walk: StageWalk,
    hidden: torch.Tensor,
    residual: torch.Tensor,
    new_qlen: np.ndarray,
    idx: torch.Tensor | None,
) -> tuple[torch.Tensor, np.ndarray]:
    """Put the stashing rows' chunks into the store; the rows (indices into this step's
    tokens, after the selection's ``idx``) and lengths that go on: a stashing row, kept
    whole by the selection, keeps its last tokens only."""
    qsl = query_start(walk.qlen)
    assert walk.positions is not None
    for r, (keys, tail) in walk.chunk_keys.items():
        a, b = int(qsl[r]), int(qsl[r + 1])
        chunk = StashedChunk(
            hidden=hidden[a:b].clone(),
            residual=residual[a:b].clone(),
            positions=walk.positions[a:b].clone(),
            keys=keys,
            tail_queries=tail[1] if tail else None,
            tail_offset=tail[0] if tail else 0,
        )
        store.get(int(walk.plan.slots[r])).chunks.append(chunk)
    walk.chunk_keys = {}
    keep = np.where(walk.plan.stashing, np.minimum(new_qlen, PLACEHOLDER_TOKENS), new_qlen)
    end = np.cumsum(new_qlen)
    picks = np.concatenate([np.arange(e - n, e) for e, n in zip(end, keep, strict=True)])
    pick = torch.from_numpy(picks.astype(np.int64)).to(hidden.device, non_blocking=True)
    return (pick if idx is None else idx[pick]), keep


def with_stashes(
    store: StashStore,
    walk: StageWalk,
    idx: torch.Tensor,
    hidden: torch.Tensor,
    residual: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The last chunks' stashed tokens after the step's own (hidden, residual and
    ``walk.positions``), ``idx`` mapped into them; the stashes are released."""
    ext = walk.extended
    assert ext is not None and walk.positions is not None
    stashes = [store.get(slot) for slot in ext.slots]
    hidden = torch.cat([hidden, *(s.cat("hidden") for s in stashes)])
    residual = torch.cat([residual, *(s.cat("residual") for s in stashes)])
    walk.positions = torch.cat([walk.positions, *(s.cat("positions") for s in stashes)])
    for slot in ext.slots:
        store.release(slot)
    return ext.to_source[idx], hidden, residual


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
