"""Start-up work of the runtime: kernel warm-up and the memory held during vLLM's profile run."""

from __future__ import annotations

import torch

from uniprefill.config import UniPrefillConfig
from uniprefill.ops import select_tokens
from uniprefill.vllm.runtime import UniPrefillRuntime
from uniprefill.vllm.step import compaction_reserve_bytes


def _runtime(cfg: UniPrefillConfig, calls: list[dict]) -> UniPrefillRuntime:
    def recording_select(q, k, cu, **kw):
        sel = select_tokens(q, k, cu, **kw)
        calls.append({"num_reqs": cu.numel() - 1, "cu": cu.tolist(), "sel": sel, **kw})
        return sel

    return UniPrefillRuntime(cfg, [1], torch.device("cpu"), 8, select_fn=recording_select)


def test_warm_up_covers_each_batch_size_class_and_keeps_decode_rows() -> None:
    calls: list[dict] = []
    rt = _runtime(UniPrefillConfig(top_p=0.9), calls)
    counts = rt.warm_up(4, 2, 32, torch.float32, 32**-0.5, max_num_reqs=300)
    assert counts == [1, 16, 256]
    assert [c["num_reqs"] for c in calls] == [1, 16, 256]
    for c in calls:
        assert c["top_p"] == 0.9 and c["keep_ratio"] is None
        assert c["allow_drop"].tolist() == [True] + [False] * (c["num_reqs"] - 1)
        prompt = c["cu"][1]
        assert prompt > rt.config.sink + rt.config.last_q  # the droppable row is scored
        lens = c["sel"].new_lens.tolist()
        assert lens[1:] == [1] * (c["num_reqs"] - 1)  # decode rows untouched
        assert rt.config.sink + rt.config.last_q <= lens[0] <= prompt
    assert rt.step is None and len(rt.table) == 0  # no state left behind


def test_warm_up_respects_max_num_reqs_and_keep_ratio() -> None:
    calls: list[dict] = []
    rt = _runtime(UniPrefillConfig(top_p=1.0, keep_ratio=0.5), calls)
    assert rt.warm_up(4, 2, 32, torch.float32, 0.2, max_num_reqs=8) == [1]
    # top_p 1.0 alone would compile nothing: the top-p variant runs at 0.99, then the ratio one.
    assert [(c["top_p"], c["keep_ratio"]) for c in calls] == [(0.99, None), (1.0, 0.5)]


def test_compaction_reserve_covers_the_two_copies_and_scratch() -> None:
    # Qwen3-Next shape on one GPU: 256K tokens a step, hidden 2048, bf16, 16 q heads.
    n = compaction_reserve_bytes(262144, 16, 2048, 2, 16, 128)
    copies = 2 * 262144 * 2048 * 2  # compacted hidden + residual beside the originals
    assert copies < n < copies + 256 * 2**20
    assert compaction_reserve_bytes(131072, 16, 2048, 2, 16, 128) < n  # grows with tokens
