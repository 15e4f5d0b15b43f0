"""UniPrefill on a Hugging Face Llama, written plainly: the oracle for the vLLM plugin.

No KV cache: every decode step recomputes the whole sequence, applying at each
drop layer the prompt-token selection made during prefill (generated tokens
are never dropped). Because attention is causal, that is exactly what the
plugin's compacted per-layer KV cache must reproduce.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb, repeat_kv

from uniprefill.ops import select_tokens


def _layer(layer, h, cos, sin, want_qk: bool):
    attn = layer.self_attn
    n, hd = h.shape[0], attn.head_dim
    x = layer.input_layernorm(h)
    q = attn.q_proj(x).view(n, -1, hd).transpose(0, 1)[None]
    k = attn.k_proj(x).view(n, -1, hd).transpose(0, 1)[None]
    v = attn.v_proj(x).view(n, -1, hd).transpose(0, 1)[None]
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    groups = q.shape[1] // k.shape[1]
    o = F.scaled_dot_product_attention(
        q, repeat_kv(k, groups), repeat_kv(v, groups), is_causal=True, scale=attn.scaling
    )
    h = h + attn.o_proj(o[0].transpose(0, 1).reshape(n, -1))
    qk = (q[0].transpose(0, 1), k[0].transpose(0, 1)) if want_qk else None
    return h, qk


def _mlp(layer, h):
    return h + layer.mlp(layer.post_attention_layernorm(h))


@torch.no_grad()
def _forward(model, ids, prompt_len, drop_layers, selections, select_kwargs):
    """Last-token logits; fills ``selections`` (prompt keep indices per drop layer) if empty."""
    inner = model.model
    h = inner.embed_tokens(torch.tensor(ids))
    pos = torch.arange(len(ids))
    n_prompt = prompt_len  # prompt tokens still alive
    for i, layer in enumerate(inner.layers):
        cos, sin = inner.rotary_emb(h[None], pos[None])
        h, qk = _layer(layer, h, cos, sin, want_qk=i in drop_layers and i not in selections)
        if i in drop_layers:
            if i not in selections:
                q, k = qk
                sel = select_tokens(
                    q[:n_prompt].contiguous(),
                    k[:n_prompt].contiguous(),
                    torch.tensor([0, n_prompt], dtype=torch.int32),
                    impl="reference",
                    **select_kwargs,
                )
                selections[i] = sel.gather_idx
            keep = selections[i]
            idx = torch.cat([keep, torch.arange(n_prompt, len(pos))])
            h, pos, n_prompt = h[idx], pos[idx], len(keep)
        h = _mlp(layer, h)
    return model.lm_head(inner.norm(h[-1:]))[0]


def greedy_with_drops(model, prompt_ids, max_tokens, drop_layers, **select_kwargs):
    """Greedy tokens of UniPrefill (selection at prefill, fixed for the decode)."""
    selections: dict[int, torch.Tensor] = {}
    ids = list(prompt_ids)
    out = []
    for _ in range(max_tokens):
        logits = _forward(model, ids, len(prompt_ids), set(drop_layers), selections, select_kwargs)
        tok = int(torch.argmax(logits))
        out.append(tok)
        ids.append(tok)
    kept = [len(selections[d]) for d in sorted(selections)]
    return out, kept
