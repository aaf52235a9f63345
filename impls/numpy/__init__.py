"""Attention in NumPy, one page per idea: ``attention.py`` is the core page; the others
(backward, flash, KV cache, packed, paged, layers) build on it by its public names."""
