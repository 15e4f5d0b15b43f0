"""UniPrefill on a Hugging Face model, written plainly: the oracle for the vLLM plugin.

No KV cache: every decode step recomputes the whole sequence layer by layer through
transformers' own decoder layers (Llama, Gemma 3/4, GPT-OSS, Qwen3-Next and Qwen3.5
share their calling convention), applying at each drop layer the prompt-token
selection made during prefill; generated tokens are never dropped. Attention runs
through a function of this module (registered with transformers' ``AttentionInterface``) that masks
causally in the index space of the tokens still alive (a sliding window counts kept
tokens, as the plugin's compacted KV does), applies GPT-OSS's attention sinks, keeps
the original positions for RoPE, and hands the drop layer's post-RoPE q/k to the
selection (without the sinks, as the plugin scores). Linear-attention layers
see the kept tokens in order. The drop is applied after the drop layer's MLP: the MLP
works token by token, so the kept tokens' values are those of a drop before it.
Because attention is causal, this is what the plugin's compacted per-layer KV cache
must reproduce.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from uniprefill.ops import select_tokens

ATTN = "uniprefill_reference"
# The drop layer's attention module -> its (q, k), [tokens, heads, head_dim], and scale.
_captured: dict[int, tuple[torch.Tensor, torch.Tensor, float]] = {}


def _attention(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    scaling: float | None = None,
    sliding_window: int | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    n = query.shape[2]
    groups = query.shape[1] // key.shape[1]
    i = torch.arange(n)
    allowed = i[None, :] <= i[:, None]
    if sliding_window:
        allowed &= i[None, :] > i[:, None] - sliding_window
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    sinks = kwargs.get("s_aux")
    if sinks is None:
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=allowed, scale=scaling)
    else:
        # GPT-OSS: a learned per-head logit joins each softmax and takes its share of
        # the probability, then is dropped (it has no value).
        logits = (query @ key.transpose(-1, -2)) * (scaling or query.shape[-1] ** -0.5)
        logits = logits.masked_fill(~allowed, float("-inf"))
        sink = sinks.reshape(1, -1, 1, 1).expand(*logits.shape[:-1], 1).to(logits.dtype)
        probs = torch.cat([logits, sink], dim=-1).softmax(dim=-1)[..., :-1]
        out = probs.to(value.dtype) @ value
    if getattr(module, "uniprefill_capture", False):
        qk = (query[0].transpose(0, 1), key[0].transpose(0, 1))
        _captured[id(module)] = (*qk, scaling or query.shape[-1] ** -0.5)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(ATTN, _attention)


def load(path: Any, dtype: torch.dtype = torch.float32) -> Any:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).eval()
    model.set_attn_implementation(ATTN)
    return model


def _layer_types(config: Any) -> list[str]:
    return list(
        getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
    )


def _position_embeddings(inner: Any, h: torch.Tensor, pos: torch.Tensor, layer_type: str) -> Any:
    try:  # Gemma 3: one rotary embedding per layer type
        return inner.rotary_emb(h, pos[None], layer_type)
    except TypeError:
        return inner.rotary_emb(h, pos[None])


def _layer_kwargs(layer: Any) -> dict[str, Any]:
    # Gemma 4 layers publish their K/V for KV-shared layers into a dict the model passes
    # (the tiny model shares none, so nothing reads it).
    if "shared_kv_states" in inspect.signature(layer.forward).parameters:
        return {"shared_kv_states": {}}
    return {}


@torch.no_grad()
def _forward(model, ids, prompt_len, drop_layers, selections, select_kwargs):
    """Last-token logits; fills ``selections`` (prompt keep indices per drop layer) if empty."""
    inner = model.model
    types = _layer_types(model.config)
    h = inner.embed_tokens(torch.tensor(ids))[None]
    pos = torch.arange(len(ids))
    n_prompt = prompt_len  # prompt tokens still alive
    for i, layer in enumerate(inner.layers):
        attn = getattr(layer, "self_attn", None)
        scoring = i in drop_layers and i not in selections
        if attn is not None:
            attn.uniprefill_capture = scoring
        h = layer(
            h,
            position_embeddings=_position_embeddings(inner, h, pos, types[i]),
            attention_mask=None,
            position_ids=pos[None],
            **_layer_kwargs(layer),
        )
        if i in drop_layers:
            if scoring:
                q, k, scale = _captured.pop(id(attn))
                sel = select_tokens(
                    q[:n_prompt].contiguous(),
                    k[:n_prompt].contiguous(),
                    torch.tensor([0, n_prompt], dtype=torch.int32),
                    impl="reference",
                    scale=scale,  # the layer's own (Gemma 3: query_pre_attn_scalar)
                    **select_kwargs,
                )
                selections[i] = sel.gather_idx
            keep = selections[i]
            idx = torch.cat([keep, torch.arange(n_prompt, len(pos))])
            h, pos, n_prompt = h[:, idx], pos[idx], len(keep)
    return model.lm_head(inner.norm(h[:, -1:]))[0, 0]


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
