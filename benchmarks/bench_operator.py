"""GPU benchmark of the UniPrefill selection operator (fused Triton scoring + selection).

For each (total tokens, batch) case, with 32 q heads / 8 kv heads, head dim 128,
bf16, defaults top_p=0.99, block_size=64, last_q=128, sink=128:

* exact agreement of the fused path with the PyTorch reference on the GPU
  (keep mask, gather indices) and the block-score difference;
* median time of ``select_tokens(impl="triton")`` end to end (scoring,
  selection and its one host sync), and of the scoring kernels alone;
* the time of one dense causal prefill attention of the same layer: torch SDPA,
  flash backend, on ``[B, 32, n, 128]`` with kv heads expanded to 32 outside
  the timed region.  The requests of a case have equal lengths, so one batched
  call does exactly the work of the block-diagonal varlen batch.

Usage: ``PYTHONPATH=$PWD/src python3 benchmarks/bench_operator.py --out $OUT/op.json``
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time

import torch
import torch.nn.functional as F
import triton.testing

from uniprefill.ops import select_tokens
from uniprefill.ops import triton_select as ts

HQ, HKV, D = 32, 8, 128


def make_case(total: int, batch: int, seed: int, sharp: float) -> tuple:
    """Random bf16 q/k/v; ``sharp`` scales q so attention is peaked and top-p drops."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = (torch.randn(total, HQ, D, device="cuda", generator=g) * sharp).bfloat16()
    k = torch.randn(total, HKV, D, device="cuda", generator=g).bfloat16()
    v = torch.randn(total, HKV, D, device="cuda", generator=g).bfloat16()
    n = total // batch
    cu = torch.arange(0, total + 1, n, dtype=torch.int32, device="cuda")
    return q, k, v, cu


def bench(fn, rep_ms: int) -> float:
    return float(triton.testing.do_bench(fn, warmup=25, rep=rep_ms, return_mode="median"))


def dense_attention_ms(q, k, v, batch: int) -> float:
    n = q.shape[0] // batch
    qb = q.view(batch, n, HQ, D).transpose(1, 2)
    kb = k.view(batch, n, HKV, D).repeat_interleave(HQ // HKV, dim=2).transpose(1, 2)
    vb = v.view(batch, n, HKV, D).repeat_interleave(HQ // HKV, dim=2).transpose(1, 2)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def run():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            F.scaled_dot_product_attention(qb, kb, vb, is_causal=True)

    return bench(run, 1000)


def check_case(q, k, cu, kw: dict) -> dict:
    fused = select_tokens(q, k, cu, impl="triton", **kw)
    ref = select_tokens(q, k, cu, impl="reference", **kw)
    again = select_tokens(q, k, cu, impl="triton", **kw)
    diff = (fused.block_scores - ref.block_scores).abs().max().item()
    rel = diff / ref.block_scores.abs().max().item()
    return {
        "mask_equal": bool(torch.equal(fused.keep, ref.keep)),
        "gather_equal": bool(torch.equal(fused.gather_idx, ref.gather_idx)),
        "repeat_bitwise_equal": bool(
            torch.equal(again.block_scores, fused.block_scores)
            and torch.equal(again.keep, fused.keep)
        ),
        "block_score_max_rel_err": rel,
        "kept_fraction": fused.num_kept / q.shape[0],
    }


def time_case(q, k, cu, kw: dict) -> dict:
    _, block_n, _, _ = ts._config(D, kw["last_q"])
    scale = 1.0 / math.sqrt(D)

    def scoring():  # layout + the three scoring kernels + kv-head sum
        lay = ts._layout(
            cu,
            None,
            min_len=kw["sink"] + kw["last_q"],
            block_n=block_n,
            block_size=kw["block_size"],
        )
        ts._score(q, k, lay, last_q=kw["last_q"], scale=scale, seg=kw["block_size"]).sum(0)

    return {
        "select_ms": bench(lambda: select_tokens(q, k, cu, impl="triton", **kw), 300),
        "scoring_ms": bench(scoring, 300),
    }


def tune(q, k, cu, kw: dict) -> list[dict]:
    """Scoring time for a few tile configs (the default is restored afterwards)."""
    out = []
    for bm, bn, w in [(64, 128, 4), (64, 64, 4), (128, 64, 8), (128, 128, 8), (64, 128, 8)]:
        ts.CONFIG_OVERRIDE.update(BLOCK_M=bm, BLOCK_N=bn, num_warps=w)
        try:
            ms = bench(
                lambda: ts.token_scores_triton(
                    q, k, cu, last_q=kw["last_q"], scale=D**-0.5, sink=kw["sink"]
                ),
                200,
            )
        except Exception as exc:  # noqa: BLE001 - report configs that fail to compile
            ms = f"error: {type(exc).__name__}"
        out.append({"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": w, "scoring_ms": ms})
    ts.CONFIG_OVERRIDE.clear()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "op.json"))
    ap.add_argument("--totals", default="8192,32768,131072")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--sharp", type=float, default=4.0)
    ap.add_argument("--tune", action="store_true")
    args = ap.parse_args()
    kw = dict(top_p=0.99, block_size=64, last_q=128, sink=128)
    rows, tuning = [], {}
    t_start = time.time()
    for total in map(int, args.totals.split(",")):
        for batch in map(int, args.batches.split(",")):
            q, k, v, cu = make_case(total, batch, seed=total + batch, sharp=args.sharp)
            row = {"total": total, "batch": batch, **check_case(q, k, cu, kw)}
            row.update(time_case(q, k, cu, kw))
            row["dense_attn_ms"] = dense_attention_ms(q, k, v, batch)
            row["select_over_dense"] = row["select_ms"] / row["dense_attn_ms"]
            rows.append(row)
            if args.tune and total == 32768:
                tuning[f"{total}x{batch}"] = tune(q, k, cu, kw)
            print(json.dumps(row), flush=True)
            del q, k, v
            torch.cuda.empty_cache()
    result = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "config": {"hq": HQ, "hkv": HKV, "d": D, "dtype": "bf16", "sharp": args.sharp, **kw},
        "dense_baseline": "torch SDPA flash backend, is_causal, [B,32,n,128], kv expanded",
        "rows": rows,
        "tuning": tuning,
        "wall_s": time.time() - t_start,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"\n{result['device']}, torch {torch.__version__}, triton {triton.__version__}")
    print(
        "| tokens | batch | mask eq | score rel err | kept | select ms | scoring ms "
        "| dense attn ms | select/dense |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['total']} | {r['batch']} | {r['mask_equal'] and r['gather_equal']} "
            f"| {r['block_score_max_rel_err']:.1e} | {r['kept_fraction']:.3f} "
            f"| {r['select_ms']:.3f} | {r['scoring_ms']:.3f} | {r['dense_attn_ms']:.2f} "
            f"| {100 * r['select_over_dense']:.1f}% |"
        )
    for name, cfgs in tuning.items():
        print(name, [(c["BLOCK_M"], c["BLOCK_N"], c["num_warps"], c["scoring_ms"]) for c in cfgs])


if __name__ == "__main__":
    main()
