"""Streaming test gradients against a store:
score, top_k, self_influence, score_chunks, merge_top_k.
"""

from tracinfunc.query.merge import merge_top_k
from tracinfunc.query.score import score, score_chunks, self_influence, top_k

__all__ = [
    "merge_top_k",
    "score",
    "score_chunks",
    "self_influence",
    "top_k",
]
