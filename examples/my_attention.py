"""Your attention, checked against the spec: copy this file and replace the function.

Run the whole conformance suite on it, from the repository root:

    pytest conformance --impl examples.my_attention:attention \\
        --impl-capabilities value_dim,causal_bottom_right,window,gqa \\
        --known-failures examples/known_failures.txt

and write a report (Markdown, JSON, JUnit XML and pictures in report-mine/):

    python -m conformance report --impl examples.my_attention:attention \\
        --impl-capabilities value_dim,causal_bottom_right,window,gqa \\
        --known-failures examples/known_failures.txt --out report-mine

``--impl`` names a function taking and returning NumPy arrays with the spec's signature
(below). ``--impl-capabilities`` lists the optional features it implements; the tests of
the others are reported as skipped with the capability's name. ``--impl-dtypes`` lists
the dtypes it accepts (default float64,float32). ``--known-failures`` lists the tests you
know fail, each with a reason; here, one deliberate gap (integer masks, see step 0).

The formula (SPEC §1.2):

    out = softmax(scale · q kᵀ, over the keys each query may attend) v

Shapes: q (B, H, T, D), k (B, K, S, D), v (B, K, S, E) -> out (B, H, T, E), where B is
the batch, H query heads, K key/value heads (H % K == 0), T queries, S keys, D the q/k
head dim and E the v head dim.
"""

from __future__ import annotations

import math

import numpy as np


def attention(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    *,
    mask: np.ndarray | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    causal_alignment: str = "top_left",
    window: tuple[int | None, int | None] | None = None,
) -> np.ndarray:
    """Scaled dot-product attention, in NumPy.

    Args:
      q: queries, (B, H, T, D).
      k: keys, (B, K, S, D); K must divide H (grouped-query attention).
      v: values, (B, K, S, E).
      mask: bool (True = may attend) or float (added to the scores, -inf blocks),
        broadcastable to (B, H, T, S).
      is_causal: query t attends only keys on or before its diagonal.
      scale: multiplies q·k; default 1/√D.
      causal_alignment: "top_left" (query t's diagonal is key t) or "bottom_right"
        (key t + S - T: the last query sees the last key, as in a KV cache).
      window: (left, right): query t attends keys within [t' - left, t' + right] of its
        diagonal t'; None leaves a side unbounded.

    Returns:
      out: (B, H, T, E), in q's dtype.
    """
    # 0. Validate. The spec asks for ValueError / TypeError naming the argument, the
    # expected shape in letters and numbers, and what was given (SPEC §8.1).
    q, k, v = np.asarray(q), np.asarray(k), np.asarray(v)
    for name, x, letters in (
        ("q", q, "(B, H, T, D)"),
        ("k", k, "(B, K, S, D)"),
        ("v", v, "(B, K, S, E)"),
    ):
        if x.ndim != 4:
            raise ValueError(f"{name} should be {letters}, rank 4, got shape {x.shape}")
        if x.dtype.kind != "f":
            raise TypeError(f"{name} should be a floating array, got dtype {x.dtype}")
        if x.dtype != q.dtype:
            raise TypeError(f"{name} dtype should be {q.dtype} like q, got {x.dtype}")
    B, H, T, D = q.shape
    K, S, E = k.shape[1], k.shape[2], v.shape[3]
    if K == 0 or H % K:
        raise ValueError(f"k heads K={K} should divide q heads H={H}, got k shape {k.shape}")
    if k.shape != (B, K, S, D):
        raise ValueError(f"k shape should be (B, K, S, D) = {(B, K, S, D)}, got {k.shape}")
    if v.shape != (B, K, S, E):
        raise ValueError(f"v shape should be (B, K, S, E) = {(B, K, S, E)}, got {v.shape}")
    if mask is not None:
        mask = np.asarray(mask)
        # KNOWN GAP: the spec rejects integer masks with a TypeError (SPEC §3.3, §8.1); this
        # function, like much training code, reads them as bool. examples/known_failures.txt
        # lists the two tests this fails, with the reason.
        if mask.dtype.kind in "iu":
            mask = mask != 0
        try:
            fits = mask.ndim <= 4 and np.broadcast_shapes(mask.shape, (B, H, T, S)) == (
                B,
                H,
                T,
                S,
            )
        except ValueError:
            fits = False
        if not fits:
            raise ValueError(
                f"mask shape should broadcast to (B, H, T, S) = {(B, H, T, S)}, got {mask.shape}"
            )
    if scale is None:
        scale = 1 / math.sqrt(D)
    elif not (isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale should be a positive finite float, got {scale!r}")
    if causal_alignment not in ("top_left", "bottom_right"):
        raise ValueError(
            f"causal_alignment should be 'top_left' or 'bottom_right', got {causal_alignment!r}"
        )
    if window is not None and not (
        isinstance(window, tuple)
        and len(window) == 2
        and all(w is None or (isinstance(w, int) and w >= 0) for w in window)
    ):
        raise ValueError(f"window should be (left, right) of ints >= 0 or None, got {window!r}")

    # Low precision would be computed in float32 (SPEC §4.5); this function declares only
    # float64 and float32, so it computes in the input dtype.
    dtype = q.dtype

    # 1. Scores, with each key/value head shared by G = H // K query heads: query head h
    # uses key/value head h // G (PyTorch's repeat_interleave).
    G = H // K
    k = np.repeat(k, G, axis=1)  # (B, H, S, D)
    v = np.repeat(v, G, axis=1)  # (B, H, S, E)
    # A score that overflows is ±inf, as SPEC §4.1 defines: the answer, not a warning.
    with np.errstate(over="ignore"):
        scores = np.einsum("bhtd,bhsd->bhts", q, k) * dtype.type(scale)  # (B, H, T, S)

    # 2. Mask: a bool mask, a float mask's -inf entries, causality and the window decide
    # which keys each query may see; a float mask's other values are added.
    allowed = np.ones((B, H, T, S), dtype=bool)  # (B, H, T, S)
    if mask is not None and mask.dtype == np.bool_:
        allowed &= mask
    elif mask is not None:
        # Blocking by selection, not by adding -inf: a NaN score plus -inf would be NaN.
        allowed &= mask != -np.inf
        # A +inf entry beside a -inf score gives NaN, as IEEE arithmetic and SPEC §3.8
        # want: that is the answer, not a fault to warn about.
        with np.errstate(invalid="ignore"):
            scores = scores + mask.astype(dtype)
    diagonal = np.arange(T)[:, None] + (0 if causal_alignment == "top_left" else S - T)  # (T, 1)
    distance = np.arange(S)[None, :] - diagonal  # (T, S): key minus the query's diagonal
    if is_causal:
        allowed &= distance <= 0
    if window is not None:
        left, right = window
        if left is not None:
            allowed &= distance >= -left
        if right is not None:
            allowed &= distance <= right
    scores = np.where(allowed, scores, -np.inf)  # (B, H, T, S)
    # A key no query may attend (padding, an unwritten cache slot) can hold anything, NaN
    # included: its value row is replaced by 0, since 0 weight times NaN is still NaN.
    unused = ~allowed.any(axis=-2)  # (B, H, S)
    v = np.where(unused[..., None], 0, v)  # (B, H, S, E)

    # 3. Softmax over the keys. Subtracting the row maximum keeps exp() from overflowing;
    # a row with no key to attend (S = 0 included) has max -inf, and gets weights 0, so
    # its output is 0 rather than NaN (SPEC §4.3).
    row_max = scores.max(axis=-1, keepdims=True, initial=-np.inf)  # (B, H, T, 1)
    row_max = np.where(np.isfinite(row_max), row_max, 0)  # (B, H, T, 1)
    p = np.exp(scores - row_max)  # (B, H, T, S)
    total = p.sum(axis=-1, keepdims=True)  # (B, H, T, 1)
    # A NaN or +inf score makes the row's weights NaN (SPEC §3.8, §4.9): inf / inf is
    # that NaN, on purpose.
    with np.errstate(invalid="ignore"):
        weights = p / np.where(total > 0, total, 1)  # (B, H, T, S)

    # 4. Weighted sum of the values.
    return np.einsum("bhts,bhse->bhte", weights, v).astype(dtype)  # (B, H, T, E)
