"""Approximate top-k over large stores: FAISS indexes with an exact re-rank from the store.

Optional: needs faiss (``pip install 'tracinfunc[search]'``), imported only when an index is
built, loaded or queried. See ``docs/search.md``.
"""

from tracinfunc.search.index import SearchIndex, build_index, load_index, store_fingerprint
from tracinfunc.search.rerank import indexed_top_k
from tracinfunc.search.retrieve import Reranked, Retriever, rerank

__all__ = ["Reranked", "Retriever", "SearchIndex", "build_index", "indexed_top_k", "load_index",
           "rerank", "store_fingerprint"]
