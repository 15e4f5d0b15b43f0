"""Tensor-parallel contract for token selection.

Under tensor parallelism each rank holds a slice of the attention heads (its
q heads and the kv heads they use), so each rank can only score with its own
heads.  ``select_tokens(..., score_allreduce=fn)`` calls ``fn(block_scores)``
exactly once, on the fp32 flat block-score tensor, *before* normalisation and
selection.  The contract for ``fn``:

* it receives a contiguous fp32 tensor whose shape is ``[T // block_size + B]``:
  it depends only on the token count, the number of requests and
  ``block_size``, so it is identical on every rank of the group (ranks see the
  same batch);
* it must replace the tensor's contents, in place, by the elementwise fp32
  SUM over the ranks of the tensor-parallel group (never a mean, never bf16);
* afterwards every rank holds bit-identical scores, and the selection stage is
  a deterministic function of the scores (stable sorts, fp64 prefix sums, no
  atomics), so every rank derives the same mask; no mask broadcast is needed.

``select_tokens`` is always called on all ranks of the group together (it is a
collective when ``score_allreduce`` is given); the ``top_p == 1`` fast path
skips scoring, and thus the collective, on every rank alike because ``top_p`` is
configuration shared by the group.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist


def make_allreduce(group: dist.ProcessGroup | None) -> Callable[[torch.Tensor], None]:
    """Return ``fn(scores)`` that sums fp32 block scores in place over ``group``.

    Pass the tensor-parallel group explicitly.  ``None`` is refused on purpose:
    falling back to the global (world) group is wrong whenever data or pipeline
    parallelism puts other ranks in the world.
    """
    if group is None:
        raise ValueError("group must be the tensor-parallel process group, got None")

    def allreduce(scores: torch.Tensor) -> None:
        if scores.dtype != torch.float32:
            raise ValueError(f"scores must be float32, got {scores.dtype}")
        dist.all_reduce(scores, op=dist.ReduceOp.SUM, group=group)

    return allreduce
