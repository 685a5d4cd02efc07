"""Streaming test gradients against a store: score, top_k, self_influence, score_chunks,
merge_top_k. Every query prepares its test gradients once (:mod:`tracinfunc.query.prepared`).
"""

from tracinfunc.query.chunks import score_chunks
from tracinfunc.query.contrast import Contrast
from tracinfunc.query.merge import merge_top_k
from tracinfunc.query.score import score
from tracinfunc.query.self_influence import self_influence
from tracinfunc.query.top_k import top_k

__all__ = [
    "Contrast",
    "merge_top_k",
    "score",
    "score_chunks",
    "self_influence",
    "top_k",
]
