"""Token-selection operator of UniPrefill (scoring + top-p block selection)."""

from uniprefill.ops.reference import Selection, select_from_block_scores
from uniprefill.ops.select import select_tokens
from uniprefill.ops.tp import make_allreduce

__all__ = ["Selection", "make_allreduce", "select_from_block_scores", "select_tokens"]
