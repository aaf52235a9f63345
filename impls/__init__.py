"""Reference implementations of scaled dot-product attention, one package per framework:
``numpy/``, ``jax/`` and ``torch/``, each a set of teaching pages (a core page first, then
flash, backward, packed, paged, the layers and, for JAX and PyTorch, the context-parallel
pages), all checking their inputs with the one shared ``contract`` package. No page imports
another framework's package (``lint-imports``: the contracts in pyproject.toml)."""
