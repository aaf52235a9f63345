"""Attention in JAX, one page per idea: ``attention.py`` is the core page (under
``jax.jit``); the others (flash, KV cache, packed, paged, layers, ring, Ulysses) build on it
by its public names."""
