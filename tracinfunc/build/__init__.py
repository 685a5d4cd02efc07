"""Building stores: checkpoints x batches -> projected gradients -> a writer -> a store.

``torch`` is torch's :func:`build_store`; ``loop`` is the one build loop torch and JAX share
(writing, resuming, progress); ``resume`` checks that a resumed build sees the same data.
"""

from tracinfunc.build.torch import build_store

__all__ = ["build_store"]
