"""Attention in JAX, one page per idea: ``attention.py`` is the core page (steps 1-7 under
``jax.jit``); the others build on it, or on each other, by their public names: gradients,
kv_cache, packed, paged and layers on the core page; flash (with flash_fast, flash_tiles,
flash_packed, flash_paged) blockwise; ring (with ring_blocks, ring_layout) and ulysses over devices."""
