"""One Triton launch for a decode step's later-stage lengths, KV slots and block tables.

On a step whose token set is the same at every layer but whose batch holds requests
compacted by an earlier drop, each later stage needs its own sequence lengths (vLLM's
minus the tokens dropped before the stage), its own KV slot per token, and with
``free_kv_blocks`` its own block table with the freed range skipped. The torch
composition of these (``kv_blocks.remap_block_table``, ``stages.slot_mapping`` and a
few ops on the lengths) is some thirty small device ops a step, each a host launch;
here they are one launch, the host cost that counts between GPU steps
(docs/kv-blocks.md, "Host cost"). ``tests/test_ops_triton.py`` checks it against the
torch composition.

A *job* is one (stage, table, KV-cache group, block size): with ``free_kv_blocks`` one per
stage group, reading that group's table; without, one per stage and attention group,
reading the shared table. Program ``(job, row)`` writes the row's length of the job's
stage, the slots of the row's tokens in the job's group, and (``remapped`` given) the
row of the job's remapped table; the job's program of row 0 also writes -1 into the
slots past the batch's last token (vLLM's pad slot, which the KV write skips).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 128


# Per-step counts are not specialised on: a value Triton specialises (1, multiples of
# 16) would compile a new variant mid-serving.
@triton.jit(do_not_specialize=["num_reqs", "num_padded", "num_tokens"])
def _stage_fill_kernel(
    tables,  # [T, R, M] int32: the block table each job reads
    freed,  # [N, 2, T] int32: per request slot, first and count skipped in each table
    idx,  # [R] request slot of each row
    dropped,  # [N, S + 1] int32: tokens dropped before each stage, per request slot
    seq_lens,  # [>= R] int32: vLLM's sequence lengths
    qsl,  # [R + 1] int32: query start of each row
    jobs,  # [J, 4] int32: (stage - 1, table, KV-cache group, block size)
    seq_out,  # [S, >= R] int32
    slots,  # [S, G, >= num_tokens] int64
    remapped,  # [T, >= R, M] int32 (unused without HAS_FREED)
    t_stride_t,
    t_stride_r,
    f_stride_n,
    f_stride_k,
    d_stride,
    so_stride,
    sl_stride_s,
    sl_stride_g,
    rm_stride_t,
    rm_stride_r,
    num_reqs,
    num_padded,  # rows with a length (vLLM's padded request count)
    num_tokens,
    num_cols,  # M
    HAS_FREED: tl.constexpr,
    BLOCK: tl.constexpr,
):
    job = tl.program_id(0)
    row = tl.program_id(1)
    stage = tl.load(jobs + job * 4)
    table = tl.load(jobs + job * 4 + 1)
    group = tl.load(jobs + job * 4 + 2)
    block_size = tl.load(jobs + job * 4 + 3)
    real = row < num_reqs
    slot = tl.load(idx + row, mask=real, other=0).to(tl.int64)
    drop = tl.load(dropped + slot * d_stride + stage + 1, mask=real, other=0)
    first = 0
    count = 0
    if HAS_FREED:
        first = tl.load(freed + slot * f_stride_n + table, mask=real, other=0)
        count = tl.load(freed + slot * f_stride_n + f_stride_k + table, mask=real, other=0)
    seq = tl.load(seq_lens + row, mask=row < num_padded, other=0) - drop
    tl.store(seq_out + stage * so_stride + row, seq, mask=row < num_padded)
    src_row = tables + table * t_stride_t + row * t_stride_r
    offs = tl.arange(0, BLOCK)
    if HAS_FREED:  # the row of the job's table with the freed range skipped
        # Only the blocks the row's KV spans (attention reads no others); a padding
        # row spans none.
        dst_row = remapped + table * rm_stride_t + row * rm_stride_r
        cols_end = tl.minimum((seq + drop + block_size - 1) // block_size, num_cols)
        for c0 in range(0, cols_end, BLOCK):
            cols = c0 + offs
            src = tl.minimum(cols + tl.where(cols >= first, count, 0), num_cols - 1)
            values = tl.load(src_row + src, mask=cols < num_cols)
            tl.store(dst_row + cols, values, mask=cols < num_cols)
    q0 = tl.load(qsl + row, mask=real, other=0)
    q1 = tl.load(qsl + row + 1, mask=real, other=0)
    ctx = seq - (q1 - q0)
    out = slots + stage * sl_stride_s + group * sl_stride_g
    for t0 in range(q0, q1, BLOCK):
        tok = t0 + offs
        pos = tl.maximum(ctx + tok - q0, 0)
        col = pos // block_size
        col = tl.minimum(col + tl.where(col >= first, count, 0), num_cols - 1)
        block = tl.load(src_row + col, mask=tok < q1, other=0).to(tl.int64)
        tl.store(out + tok, block * block_size + pos % block_size, mask=tok < q1)
    # Tokens past the last row (padding): the pad slot, written by row 0's program.
    tail = tl.load(qsl + num_reqs)
    tail_end = tl.where(row == 0, num_tokens, 0)
    for t0 in range(tail, tail_end, BLOCK):
        tok = t0 + offs
        tl.store(out + tok, tl.full([BLOCK], -1, tl.int64), mask=tok < num_tokens)


def fill_stages(
    tables: torch.Tensor,
    freed: torch.Tensor | None,
    idx: torch.Tensor,
    dropped: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    jobs: torch.Tensor,
    num_reqs: int,
    num_padded: int,
    num_tokens: int,
    seq_out: torch.Tensor,
    slots: torch.Tensor,
    remapped: torch.Tensor | None,
) -> None:
    """Fill ``seq_out`` [S, >=num_padded], ``slots`` [S, G, >=num_tokens] and, with
    ``freed`` [N, 2, T], ``remapped`` [T, >=R, M] for the jobs ``jobs`` [J, 4]
    (stage - 1, table, group, block size of the table) in one launch; the module
    docstring says what each is.

    ``tables`` [T, R, M], ``idx`` [>=num_reqs] request slots,
    ``dropped`` [N, S + 1]. Device ops only, no host sync: safe before a graph replay.
    """
    num_tables, _, num_cols = tables.shape
    if freed is not None and (remapped is None or freed.shape[-1] != num_tables):
        raise ValueError("fill_stages: freed ranges need one range and one output per table")
    grid = (jobs.shape[0], num_padded)
    _stage_fill_kernel[grid](
        tables,
        freed if freed is not None else tables,
        idx,
        dropped,
        seq_lens,
        query_start_loc,
        jobs,
        seq_out,
        slots,
        remapped if remapped is not None else tables,
        tables.stride(0),
        tables.stride(1),
        freed.stride(0) if freed is not None else 0,
        freed.stride(1) if freed is not None else 0,
        dropped.stride(0),
        seq_out.stride(0),
        slots.stride(0),
        slots.stride(1),
        remapped.stride(0) if remapped is not None else 0,
        remapped.stride(1) if remapped is not None else 0,
        num_reqs,
        num_padded,
        num_tokens,
        num_cols,
        HAS_FREED=freed is not None,
        BLOCK=_BLOCK,
    )
