"""Keras 3's ``keras.ops.dot_product_attention`` on its JAX backend: the adapter the
``keras.ops.dot_product_attention`` profile calls.

Keras chooses its backend once, when it is first imported, from ``KERAS_BACKEND`` (else
``~/.keras/keras.json``, whose default is TensorFlow). This module asks for JAX where
nothing chose yet and refuses to run on another backend, rather than measure that one
under JAX's name. The call itself is Keras' own, keywords and arrays as they are.
"""

from __future__ import annotations

import os
from typing import Any

BACKEND = "jax"


def _keras() -> Any:
    os.environ.setdefault("KERAS_BACKEND", BACKEND)
    import keras

    if keras.backend.backend() != BACKEND:
        raise RuntimeError(
            f"keras runs on its {keras.backend.backend()!r} backend in this process "
            f"(KERAS_BACKEND={os.environ.get('KERAS_BACKEND')!r}); this profile measures "
            f"the {BACKEND!r} one: set KERAS_BACKEND={BACKEND} before keras is imported"
        )
    return keras


def dot_product_attention(
    query, key, value, bias=None, mask=None, scale=None, is_causal=False, flash_attention=None
):
    """``keras.ops.dot_product_attention``, on JAX, with its keywords (named here, so that
    ``jax.jit`` can hold the options static, as in a compiled Keras model)."""
    return _keras().ops.dot_product_attention(
        query, key, value, bias=bias, mask=mask, scale=scale, is_causal=is_causal,
        flash_attention=flash_attention,
    )  # fmt: skip
