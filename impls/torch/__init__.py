"""Attention in PyTorch, one page per idea: the core pages ``naive.py`` (the formula by
hand), ``module.py`` (an ``nn.Module``) and ``sdpa.py`` (``F.scaled_dot_product_attention``);
the others (KV cache, packed, paged, ring, Ulysses) build on them by their public names."""
