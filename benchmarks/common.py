"""Shared helpers of the GPU benchmarks: model shapes, model folders, engines, logging.

The models are randomly initialised (vLLM's dummy loader) in the shapes of real
checkpoints; only ``config.json`` and a tiny tokenizer are written.
"""

from __future__ import annotations

import gc
import random
import re
import subprocess
import time
from pathlib import Path
from typing import Any

from uniprefill.cpu_triton import enable as _enable_cpu_triton

# Before anything imports vLLM: on a CPU machine (the --smoke-cpu runs) vLLM's V2
# runner needs Triton's interpreter; on a GPU this does nothing.
_enable_cpu_triton()

KB = 1024

# ---- model shapes ---------------------------------------------------------------------------
# name -> (family, builder kwargs, engine defaults). Drop layers: the family default
# unless given. Qwen3-Next: 16 of 48 layers (full attention at 3, 7, 11, 15) so
# that 512 experts fit one H200; drops at 3, 7, 11 put 75% of the layers after the
# first drop (the real 48-layer schedule 7, 11, ..., 43 puts 83% there).
MODELS: dict[str, dict[str, Any]] = {
    "llama8b": {"family": "llama", "budget_tokens": 256 * KB, "drop_layers": None},
    "qwen3next": {"family": "qwen3_next", "budget_tokens": 256 * KB, "drop_layers": [3, 7, 11]},
    "gemma3": {"family": "gemma3", "budget_tokens": 128 * KB, "drop_layers": None},
    # CPU smoke test: tiny shapes, same code path.
    "tiny-llama": {"family": "llama", "budget_tokens": 4 * KB, "drop_layers": None},
}


def hf_config(name: str, max_pos: int) -> Any:
    """The transformers config of ``name`` (no weights)."""
    if name == "llama8b":
        from transformers import LlamaConfig

        cfg = LlamaConfig(
            vocab_size=128256,
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            max_position_embeddings=max(max_pos, 131072),
            rms_norm_eps=1e-5,
            rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
            tie_word_embeddings=False,
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=0,
        )
        cfg.architectures = ["LlamaForCausalLM"]
    elif name == "gemma3":
        from transformers import Gemma3TextConfig

        n = 48
        cfg = Gemma3TextConfig(
            vocab_size=262208,
            hidden_size=3840,
            intermediate_size=15360,
            num_hidden_layers=n,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=256,
            sliding_window=1024,
            layer_types=[
                "full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(n)
            ],
            query_pre_attn_scalar=256,
            max_position_embeddings=max(max_pos, 131072),
            tie_word_embeddings=True,
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=0,
        )
        cfg.architectures = ["Gemma3ForCausalLM"]
    elif name == "qwen3next":
        from transformers import Qwen3NextConfig

        n = 16
        cfg = Qwen3NextConfig(
            vocab_size=151936,
            hidden_size=2048,
            intermediate_size=5120,
            num_hidden_layers=n,
            num_attention_heads=16,
            num_key_value_heads=2,
            head_dim=256,
            layer_types=[
                "full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(n)
            ],
            full_attention_interval=4,
            linear_conv_kernel_dim=4,
            linear_key_head_dim=128,
            linear_value_head_dim=128,
            linear_num_key_heads=16,
            linear_num_value_heads=32,
            num_experts=512,
            num_experts_per_tok=10,
            moe_intermediate_size=512,
            shared_expert_intermediate_size=512,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            norm_topk_prob=True,
            partial_rotary_factor=0.25,
            max_position_embeddings=max(max_pos, 262144),
            tie_word_embeddings=False,
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=0,
        )
        cfg.architectures = ["Qwen3NextForCausalLM"]
    elif name == "tiny-llama":
        from uniprefill.testing.tiny_models import tiny_config

        cfg = tiny_config("llama", max_position_embeddings=max(max_pos, 4096))
        cfg.architectures = ["LlamaForCausalLM"]
    else:
        raise ValueError(f"unknown model {name!r}; choose from {sorted(MODELS)}")
    return cfg


def build_model_dir(
    name: str, root: Path, max_pos: int, dtype: str, num_layers: int | None = None
) -> Path:
    """config.json + tokenizer only; vLLM's dummy loader makes the weights.

    ``num_layers`` keeps the first layers of the shape (faster start-up for checks).
    """
    from uniprefill.testing.tiny_models import build_tiny_tokenizer

    out = root / (name if num_layers is None else f"{name}-{num_layers}l")
    out.mkdir(parents=True, exist_ok=True)
    cfg = hf_config(name, max_pos)
    if num_layers is not None:
        cfg.num_hidden_layers = num_layers
        if getattr(cfg, "layer_types", None):
            cfg.layer_types = cfg.layer_types[:num_layers]
    cfg.dtype = dtype
    cfg.save_pretrained(str(out))
    if not (out / "tokenizer.json").exists():
        build_tiny_tokenizer(out)
    return out


LOG_PREFIX = ["bench"]


def log(msg: str) -> None:
    print(f"[{LOG_PREFIX[0]} {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def gpu_used_mib() -> int | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        return int(out.stdout.split()[0])
    except Exception:
        return None


def wait_gpu_free(limit_mib: int = 4000, timeout_s: float = 60.0) -> None:
    t0 = time.time()
    while time.time() - t0 < timeout_s:
        used = gpu_used_mib()
        if used is None or used < limit_mib:
            return
        time.sleep(1.0)
    log(f"warning: GPU still holds {gpu_used_mib()} MiB after {timeout_s:.0f} s")


def random_prompts(lengths: list[int], seed: int, shuffle: bool = False) -> list[dict[str, Any]]:
    """Prompts of random token ids, one per length (in a seeded random order with
    ``shuffle``): the same seed gives the same prompts in every script."""
    rng = random.Random(seed)
    lengths = list(lengths)
    if shuffle:
        rng.shuffle(lengths)
    # ids 5..999: inside the tiny tokenizer's vocab (1024) and every model's.
    return [{"prompt_token_ids": [rng.randrange(5, 1000) for _ in range(n)]} for n in lengths]


def batch_prompts(length: int, conc: int, seed: int) -> list[dict[str, Any]]:
    """``conc`` random prompts of ``length`` tokens."""
    return random_prompts([length] * conc, seed)


# ---- modes: how a benchmark names the plugin's selection settings ----------------------------
_MODE = re.compile(r"^(dense|topp(0?\.\d+|1(\.0*)?)|keep(0?\.\d+|1(\.0*)?))$")


def mode_options(mode: str) -> dict[str, Any]:
    """The uniprefill options of a mode name: ``dense`` (top_p 1, the plugin's dense
    path), ``topp<P>`` (top_p P) or ``keep<R>`` (keep_ratio R, top_p 0.99)."""
    if not _MODE.match(mode):
        raise ValueError(f"bad mode {mode!r}: use dense, topp<P> (topp0.99) or keep<R> (keep0.3)")
    if mode == "dense":
        return {"top_p": 1.0, "keep_ratio": None}
    if mode.startswith("topp"):
        return {"top_p": float(mode[4:]), "keep_ratio": None}
    return {"top_p": 0.99, "keep_ratio": float(mode[4:])}


def close_llm(llm: Any) -> None:
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception as e:  # noqa: BLE001
        log(f"shutdown: {e!r}")
    del llm
    gc.collect()
