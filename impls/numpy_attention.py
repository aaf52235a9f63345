"""Scaled dot-product attention in NumPy: the reference every other impl mirrors.

    out = softmax(mask(softcap(scale · q kᵀ))) v

Step by step, for one query row t:

    score[s]  = scale · Σ_d q[t, d] · k[s, d]          scale defaults to 1/√D
    score[s]  = c · tanh(score[s] / c)                  only with softcap=c
    score[s]  = score[s] + mask[t, s]                   a float mask is added;
    score[s]  = -inf where the key s is blocked         a bool mask, causal or window blocks
    w[s]      = exp(score[s] - max) / Σ exp(score - max)
    out[t, e] = Σ_s w[s] · v[s, e]

Why 1/√D: if the entries of q and k have unit variance, q·k sums D such products and has
variance D; dividing by √D keeps the scores near unit variance whatever the head size, so
the softmax neither saturates (one-hot weights, vanishing gradients) nor flattens.

Shape legend (heads-first, as in PyTorch):

    B batch            H query heads      K key/value heads (H % K == 0)
    G = H // K         T query length     S key/value length
    D q/k head dim     E v head dim       C model width (module only)

    q (B, H, T, D)    k (B, K, S, D)    v (B, K, S, E)    out (B, H, T, E)
    mask: bool (True = may attend) or floating (added to the scores),
          broadcastable to (B, H, T, S)

Unbatched inputs q (H, T, D), k (K, S, D), v (K, S, E) give out (H, T, E).

Supports: bool and float masks, causal masking aligned top-left or bottom-right, sliding
windows, softcapping, grouped-query and multi-query attention (K < H), dropout on the
weights (with an explicit ``numpy.random.Generator``), float64, float32, float16 and
bfloat16 (``ml_dtypes``). A query row with no key left to attend returns exactly 0.
Float16 and bfloat16 inputs are computed in float32 and the result rounded once.

Also here: a KV cache for step-by-step decoding, and the multi-head layer and pre-LN GPT
block as functions of a parameter dict laid out like the PyTorch module's ``state_dict``
(``Linear`` weight (out, in), bias (out)).

And the backward pass, written by hand as a derivation: ``attention_backward`` walks the
steps above in reverse (dV = Pᵀ·dO, dP = dO·Vᵀ, dS = P ⊙ (dP − rowsum(dO ⊙ O)),
dQ = scale·dS·K, dK = scale·dSᵀ·Q, with the softcap chain rule and the GQA group sums),
and ``multi_head_attention_backward`` / ``gpt_block_backward`` give the modules'
parameter gradients.
"""

from __future__ import annotations

import math

import numpy as np

ALIGNMENTS = ("top_left", "bottom_right")


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
    softcap: float | None = None,
    dropout_p: float = 0.0,
    rng: np.random.Generator | None = None,
) -> np.ndarray:
    """Scaled dot-product attention.

    Args:
      q: queries, (B, H, T, D) or unbatched (H, T, D).
      k: keys, (B, K, S, D) or (K, S, D); K must divide H.
      v: values, (B, K, S, E) or (K, S, E).
      mask: bool (True = may attend) or floating (added to the scores, -inf blocks),
        broadcastable to (B, H, T, S).
      is_causal: query t attends only keys s on or before its diagonal.
      scale: multiplies q·k; defaults to 1/√D.
      causal_alignment: where the diagonal sits when T != S. "top_left": s <= t.
        "bottom_right": s <= t + S - T (the last query sees the last key, as in a KV cache).
        Also places the window's diagonal.
      window: (left, right): query t attends keys in [t' - left, t' + right] where t' is
        its aligned diagonal; None on a side is unbounded.
      softcap: scores become softcap · tanh(scores / softcap) before masking.
      dropout_p: probability of zeroing each attention weight (needs ``rng``).
      rng: the random generator that draws the dropout mask.

    Returns:
      out: (B, H, T, E), or (H, T, E) for unbatched input; same dtype as q.
    """
    # 0. Validate: every problem is reported with the argument's name, the expected shape
    # in letters and numbers, and what was given.
    q, k, v = np.asarray(q), np.asarray(k), np.asarray(v)
    _check_inputs(q, k, v)
    unbatched = q.ndim == 3
    if unbatched:
        q, k, v = q[None], k[None], v[None]
    B, H, T, D = q.shape
    _, K, S, _ = k.shape
    E = v.shape[-1]
    G = H // K
    mask = _check_mask(mask, (B, H, T, S), unbatched)
    scale = _check_options(D, scale, is_causal, causal_alignment, window, softcap, dropout_p, rng)

    # Low precision inputs are computed in float32: exp() of a float16 score overflows
    # past 11.09, and summing many weights in float16 loses the small ones.
    out_dtype = q.dtype
    work = np.float64 if out_dtype == np.float64 else np.float32
    q, k, v = q.astype(work), k.astype(work), v.astype(work)

    # 1. Scores: every query against every key of its group's key/value head. Query head
    # h = k·G + g shares key/value head k (PyTorch's repeat_interleave, not tiling).
    q = q.reshape(B, K, G, T, D)  # (B, K, G, T, D)
    scores = np.einsum("bkgtd,bksd->bkgts", q, k)  # (B, K, G, T, S)

    # 2. Scale, so that the scores' spread does not grow with the head size D.
    scores = scores * work(scale)  # (B, K, G, T, S)

    # 3. Softcap: squash the scores smoothly into (-softcap, softcap).
    if softcap is not None:
        scores = softcap * np.tanh(scores / softcap)  # (B, K, G, T, S)

    # 4. Mask: a float mask is added; a bool mask, the causal triangle and the window
    # decide which keys each query may see at all.
    allowed = np.ones((1, 1, T, S), dtype=bool)  # (1, 1, T, S)
    if mask is not None and mask.dtype == np.bool_:
        allowed = allowed & mask  # (B|1, H|1, T, S)
    elif mask is not None:
        scores = scores + _grouped(mask.astype(work), K, G)  # (B, K, G, T, S)
    if is_causal or window is not None:
        allowed = allowed & _band(T, S, is_causal, causal_alignment, window)
    scores = np.where(_grouped(allowed, K, G), scores, -np.inf)  # (B, K, G, T, S)

    # 5. Softmax over the keys. Subtracting the row maximum keeps exp() <= 1, so large
    # scores cannot overflow. A row with every key blocked has max -inf; it is given
    # weights of exactly 0 (as PyTorch SDPA and FlashAttention do) instead of
    # the NaN that exp(-inf - -inf) would give.
    row_max = scores.max(axis=-1, keepdims=True)  # (B, K, G, T, 1)
    row_max = np.where(np.isfinite(row_max), row_max, 0.0)  # (B, K, G, T, 1)
    p = np.exp(scores - row_max)  # (B, K, G, T, S)
    row_sum = p.sum(axis=-1, keepdims=True)  # (B, K, G, T, 1)
    weights = p / np.where(row_sum > 0, row_sum, 1.0)  # (B, K, G, T, S)

    # 6. Dropout: zero each weight with probability dropout_p and rescale the survivors
    # by 1 / (1 - dropout_p), so the expected output is unchanged.
    if dropout_p > 0:
        keep = rng.random((B, H, T, S)) >= dropout_p  # (B, H, T, S)
        keep = keep.reshape(B, K, G, T, S)  # (B, K, G, T, S)
        weights = weights * keep / (1.0 - dropout_p)  # (B, K, G, T, S)

    # 7. Weighted sum of the values, then the query heads back in order h = k·G + g.
    out = np.einsum("bkgts,bkse->bkgte", weights, v)  # (B, K, G, T, E)
    out = out.reshape(B, H, T, E).astype(out_dtype)  # (B, H, T, E)
    return out[0] if unbatched else out


def _grouped(x: np.ndarray, K: int, G: int) -> np.ndarray:
    """Broadcast a (B|1, H|1, T, S) array onto the grouped layout (B|1, K|1, G|1, T, S)."""
    b, h, t, s = x.shape
    if h == 1:
        return x.reshape(b, 1, 1, t, s)  # (B|1, 1, 1, T, S)
    return x.reshape(b, K, G, t, s)  # (B|1, K, G, T, S)


def _band(
    T: int,
    S: int,
    is_causal: bool,
    causal_alignment: str,
    window: tuple[int | None, int | None] | None,
) -> np.ndarray:
    """Which keys each query may see under causality and the window: (1, 1, T, S) bool."""
    # Query t's diagonal is key t (top-left) or key t + S - T (bottom-right, so that the
    # last query lines up with the last key).
    offset = 0 if causal_alignment == "top_left" else S - T
    t = np.arange(T)[:, None]  # (T, 1)
    s = np.arange(S)[None, :]  # (1, S)
    distance = s - (t + offset)  # (T, S)
    allowed = np.ones((T, S), dtype=bool)  # (T, S)
    if is_causal:
        allowed &= distance <= 0
    if window is not None:
        left, right = window
        if left is not None:
            allowed &= distance >= -left
        if right is not None:
            allowed &= distance <= right
    return allowed[None, None]  # (1, 1, T, S)


def _is_float(a: np.ndarray) -> bool:
    # bfloat16 from ml_dtypes has kind "V", so it is recognised by name.
    return a.dtype.kind == "f" or a.dtype.name == "bfloat16"


def _check_inputs(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> None:
    if q.ndim not in (3, 4):
        raise ValueError(
            f"q should have rank 4 (B, H, T, D) or 3 (H, T, D), got rank {q.ndim} "
            f"with shape {q.shape}"
        )
    letters = "(B, K, S, D)" if q.ndim == 4 else "(K, S, D)"
    for name, x in (("k", k), ("v", v)):
        if x.ndim != q.ndim:
            raise ValueError(
                f"{name} should have rank {q.ndim} {letters} like q, got rank {x.ndim} "
                f"with shape {x.shape}"
            )
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not _is_float(x):
            raise TypeError(f"{name} should be a floating array, got dtype {x.dtype}")
    for name, x in (("k", k), ("v", v)):
        if x.dtype != q.dtype:
            raise TypeError(f"{name} dtype should be {q.dtype} like q, got {x.dtype}")
    q4, k4, v4 = (x if x.ndim == 4 else x[None] for x in (q, k, v))
    B, H, T, D = q4.shape
    _, K, S, _ = k4.shape
    E = v4.shape[-1]
    batch = "B, " if q.ndim == 4 else ""
    drop = 0 if q.ndim == 4 else 1
    if K == 0 or H % K != 0:
        raise ValueError(
            f"k heads K={K} should divide q heads H={H} (grouped-query attention shares "
            f"each key/value head among H // K query heads), got k shape {k.shape}"
        )
    want_k = (B, K, S, D)[drop:]
    if k.shape != want_k:
        raise ValueError(
            f"k shape should be ({batch}K, S, D) = {want_k} to match q {q.shape}, got {k.shape}"
        )
    want_v = (B, K, S, E)[drop:]
    if v.shape[:-1] != want_v[:-1]:
        raise ValueError(
            f"v shape should be ({batch}K, S, E) = {want_v} to match k {k.shape}, got {v.shape}"
        )


def _check_mask(
    mask: np.ndarray | None, shape: tuple[int, int, int, int], unbatched: bool
) -> np.ndarray | None:
    """Return the mask as a (B|1, H|1, T, S) array, or None."""
    if mask is None:
        return None
    mask = np.asarray(mask)
    if mask.dtype != np.bool_ and not _is_float(mask):
        raise TypeError(
            f"mask dtype should be bool (True = may attend) or floating (added to the "
            f"scores), got {mask.dtype}: an integer mask is ambiguous"
        )
    want = shape[1:] if unbatched else shape
    letters = "(H, T, S)" if unbatched else "(B, H, T, S)"
    try:
        fits = mask.ndim <= len(want) and np.broadcast_shapes(mask.shape, want) == want
    except ValueError:
        fits = False
    if not fits:
        raise ValueError(f"mask shape should broadcast to {letters} = {want}, got {mask.shape}")
    mask = mask.reshape((1,) * (4 - mask.ndim) + mask.shape)  # (B|1, H|1, T|1, S|1)
    B, H, T, S = shape
    b, h = mask.shape[0], mask.shape[1]
    return np.broadcast_to(mask, (b, h, T, S))  # (B|1, H|1, T, S)


def _check_options(
    D: int,
    scale: float | None,
    is_causal: bool,
    causal_alignment: str,
    window: tuple[int | None, int | None] | None,
    softcap: float | None,
    dropout_p: float,
    rng: np.random.Generator | None,
) -> float:
    """Check the keyword options; return the scale to use."""
    if not isinstance(is_causal, (bool, np.bool_)):
        raise TypeError(f"is_causal should be a bool, got {is_causal!r}")
    if causal_alignment not in ALIGNMENTS:
        raise ValueError(
            f"causal_alignment should be one of {ALIGNMENTS}, got {causal_alignment!r}"
        )
    if window is not None:
        if not isinstance(window, (tuple, list)) or len(window) != 2:
            raise ValueError(
                f"window should be a pair (left, right) of ints >= 0 or None, got {window!r}"
            )
        for side in window:
            if side is not None and (
                isinstance(side, bool) or not isinstance(side, int) or side < 0
            ):
                raise ValueError(
                    f"window should be a pair (left, right) of ints >= 0 or None, got {window!r}"
                )
    if softcap is not None and not (
        isinstance(softcap, (int, float)) and math.isfinite(softcap) and softcap > 0
    ):
        raise ValueError(f"softcap should be a positive finite float, got {softcap!r}")
    if not (isinstance(dropout_p, (int, float)) and 0.0 <= dropout_p < 1.0):
        raise ValueError(f"dropout_p should be a float in [0, 1), got {dropout_p!r}")
    if dropout_p > 0 and not isinstance(rng, np.random.Generator):
        raise ValueError(f"rng should be a numpy.random.Generator when dropout_p > 0, got {rng!r}")
    if scale is None:
        return 1.0 / math.sqrt(D)
    if isinstance(scale, bool) or not isinstance(scale, (int, float, np.floating)):
        raise TypeError(f"scale should be a positive float or None, got {scale!r}")
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale should be a positive finite float, got {scale!r}")
    return float(scale)


class KVCache:
    """Keys and values of the tokens decoded so far, for one sequence batch.

    Decoding feeds a few new tokens at a time. Their queries must see every cached key
    and, among themselves, only earlier ones: that is causal attention aligned
    bottom-right, because the new queries are the *last* T of the S positions.

        cache = KVCache()
        for q_t, k_t, v_t in chunks:            # (B, H, T, D), (B, K, T, D), (B, K, T, E)
            out_t = cache.attend(q_t, k_t, v_t)  # (B, H, T, E)
    """

    def __init__(self) -> None:
        self.k: np.ndarray | None = None  # (B, K, S, D)
        self.v: np.ndarray | None = None  # (B, K, S, E)

    def attend(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, **options) -> np.ndarray:
        """Append k, v to the cache, then attend the new queries to everything cached."""
        if self.k is None:
            self.k, self.v = k, v
        else:
            self.k = np.concatenate([self.k, k], axis=-2)  # (B, K, S, D)
            self.v = np.concatenate([self.v, v], axis=-2)  # (B, K, S, E)
        return attention(
            q,
            self.k,
            self.v,
            is_causal=True,
            causal_alignment="bottom_right",
            **options,
        )  # (B, H, T, E)


def linear(x: np.ndarray, weight: np.ndarray, bias: np.ndarray) -> np.ndarray:
    """y = x Wᵀ + b with PyTorch's layout: weight (out, in), bias (out)."""
    return x @ weight.T + bias


def layer_norm(
    x: np.ndarray, weight: np.ndarray, bias: np.ndarray, eps: float = 1e-5
) -> np.ndarray:
    """Normalise the last axis to zero mean and unit (biased) variance, then scale and shift."""
    mean = x.mean(axis=-1, keepdims=True)
    var = ((x - mean) ** 2).mean(axis=-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * weight + bias


def gelu(x: np.ndarray) -> np.ndarray:
    """The exact GELU, x · Φ(x), as ``nn.GELU()`` computes it (not the tanh approximation)."""
    erf = np.vectorize(math.erf, otypes=[np.float64])
    return (x * 0.5 * (1.0 + erf(x / math.sqrt(2.0)))).astype(x.dtype)


def multi_head_attention(
    params: dict[str, np.ndarray],
    x: np.ndarray,
    *,
    n_heads: int,
    mask: np.ndarray | None = None,
    is_causal: bool = False,
    dropout_p: float = 0.0,
    rng: np.random.Generator | None = None,
) -> np.ndarray:
    """The multi-head self-attention layer, as a function of its parameters.

    Args:
      params: "qkv.weight" (3C, C), "qkv.bias" (3C,), "out_proj.weight" (C, C),
        "out_proj.bias" (C,): the PyTorch module's ``state_dict``.
      x: (B, T, C).
      n_heads: H, which must divide C.
      mask, is_causal, dropout_p, rng: as for ``attention``, with S = T.

    Returns:
      (B, T, C)
    """
    x = np.asarray(x)
    if x.ndim != 3:
        raise ValueError(f"x shape should be (B, T, C), got {x.shape}")
    B, T, C = x.shape
    H = n_heads
    if not isinstance(H, int) or H <= 0 or C % H != 0:
        raise ValueError(f"n_heads H={H} should be a positive int dividing the model width C={C}")
    D = C // H

    # 1. Project to queries, keys and values with one fused matrix, then split them.
    qkv = linear(x, params["qkv.weight"], params["qkv.bias"])  # (B, T, 3C)
    q, k, v = np.split(qkv, 3, axis=-1)  # 3 × (B, T, C)

    # 2. Split the width into H heads of D channels: head h owns channels [h·D, (h+1)·D).
    q = q.reshape(B, T, H, D).transpose(0, 2, 1, 3)  # (B, H, T, D)
    k = k.reshape(B, T, H, D).transpose(0, 2, 1, 3)  # (B, H, T, D)
    v = v.reshape(B, T, H, D).transpose(0, 2, 1, 3)  # (B, H, T, D)

    # 3. Attention in every head at once.
    context = attention(
        q, k, v, mask=mask, is_causal=is_causal, dropout_p=dropout_p, rng=rng
    )  # (B, H, T, D)

    # 4. Merge the heads back into the width, head-major, then mix them.
    context = context.transpose(0, 2, 1, 3).reshape(B, T, C)  # (B, T, C)
    return linear(context, params["out_proj.weight"], params["out_proj.bias"])


def gpt_block(params: dict[str, np.ndarray], x: np.ndarray, *, n_heads: int) -> np.ndarray:
    """One pre-LN decoder block: x + attn(norm1(x)), then + mlp(norm2(x)).

    Args:
      params: the ``state_dict`` of the PyTorch block: "norm1.*", "attn.*", "norm2.*",
        "mlp.0.*" (Linear C -> F), "mlp.2.*" (Linear F -> C).
      x: (B, T, C).
      n_heads: H, which must divide C.

    Returns:
      (B, T, C)
    """
    attn = {name[5:]: p for name, p in params.items() if name.startswith("attn.")}
    h = layer_norm(x, params["norm1.weight"], params["norm1.bias"])  # (B, T, C)
    x = x + multi_head_attention(attn, h, n_heads=n_heads, is_causal=True)  # (B, T, C)
    h = layer_norm(x, params["norm2.weight"], params["norm2.bias"])  # (B, T, C)
    h = gelu(linear(h, params["mlp.0.weight"], params["mlp.0.bias"]))  # (B, T, F)
    return x + linear(h, params["mlp.2.weight"], params["mlp.2.bias"])  # (B, T, C)


# --- The backward pass ---------------------------------------------------------------------
#
# Given the gradient dO = ∂L/∂out of some loss L, the backward pass returns ∂L/∂q, ∂L/∂k,
# ∂L/∂v (and ∂L/∂mask for a float mask). It walks the forward's steps in reverse, each
# step turning the gradient of its output into the gradient of its input by the chain
# rule. Writing P for the weights, O for the output and Z for the scores fed to the
# softmax (after softcap and the mask), for one query row t:
#
#     O[t]  = Σ_s P[t,s] · v[s]                →  dv[s]   = Σ_t P[t,s] · dO[t]        dV = Pᵀ·dO
#                                               →  dP[t,s] = dO[t] · v[s]               dP = dO·Vᵀ
#     P[t]  = softmax(Z[t])                     →  dZ[t,s] = P[t,s] · (dP[t,s] − Σ_s' P[t,s'] dP[t,s'])
#                                                         = P[t,s] · (dP[t,s] − dO[t]·O[t])
#     Z     = C + mask                          →  dmask = dZ,  dC = dZ
#     C     = c · tanh(R / c)                   →  dR = dC · (1 − tanh²(R / c))
#     R     = scale · q kᵀ                      →  dq = scale · dR · k,   dk = scale · dRᵀ · q
#
# Why the softmax line: ∂P[s]/∂Z[s'] = P[s] (δ(s, s') − P[s']), so
# dZ[s] = Σ_s' dP[s'] P[s'] (δ(s', s) − P[s]) = P[s] (dP[s] − Σ_s' P[s'] dP[s']), and the
# sum Σ_s' P[s'] dP[s'] = Σ_s' P[s'] (dO · v[s']) = dO · O: one dot product per row, from
# the output the forward already made (FlashAttention's "D" term), not a (T, S) reduction.
#
# Blocked keys need no step of their own: their weight P is exactly 0, so dZ = 0 there and
# nothing flows to their keys, values or mask entries. A row with no key at all has P = 0
# and O = 0 and so gets zero gradients, never NaN.


def attention_backward(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    d_out: np.ndarray,
    *,
    mask: np.ndarray | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    causal_alignment: str = "top_left",
    window: tuple[int | None, int | None] | None = None,
    softcap: float | None = None,
    dropout_p: float = 0.0,
) -> tuple[np.ndarray, ...]:
    """Gradients of ``attention`` with respect to q, k, v (and a float mask).

    Args:
      q, k, v, mask, is_causal, scale, causal_alignment, window, softcap: as for
        ``attention`` (no dropout: the backward of a random draw needs the draw itself).
      d_out: ∂L/∂out, the gradient arriving from above, shaped like the output:
        (B, H, T, E) or unbatched (H, T, E), same dtype as q.
      dropout_p: must be 0.

    Returns:
      (dq, dk, dv): (B, H, T, D), (B, K, S, D), (B, K, S, E), or unbatched without B;
      same dtype as q. With a floating mask, (dq, dk, dv, dmask) with dmask shaped and
      typed like the mask: ∂L/∂mask, summed over the axes the mask was broadcast along.
    """
    # 0. Validate exactly as the forward does, then check d_out against the output shape.
    if dropout_p != 0.0:
        raise NotImplementedError(
            f"dropout_p: the backward pass takes no dropout (it would need the forward's "
            f"random draw), got dropout_p={dropout_p!r}"
        )
    q, k, v, d_out = np.asarray(q), np.asarray(k), np.asarray(v), np.asarray(d_out)
    _check_inputs(q, k, v)
    unbatched = q.ndim == 3
    if unbatched:
        q, k, v, d_out = q[None], k[None], v[None], d_out[None]
    B, H, T, D = q.shape
    _, K, S, _ = k.shape
    E = v.shape[-1]
    G = H // K
    _check_d_out(d_out, (B, H, T, E), q.dtype, unbatched)
    mask_shape = None if mask is None else np.shape(mask)
    mask_dtype = None if mask is None else np.asarray(mask).dtype
    mask = _check_mask(mask, (B, H, T, S), unbatched)
    scale = _check_options(D, scale, is_causal, causal_alignment, window, softcap, 0.0, None)

    out_dtype = q.dtype
    work = np.float64 if out_dtype == np.float64 else np.float32
    q, k, v = q.astype(work), k.astype(work), v.astype(work)
    d_out = d_out.astype(work)

    # Forward steps 1-5 again, keeping the raw scores R and the weights P.
    q = q.reshape(B, K, G, T, D)  # (B, K, G, T, D)
    raw = np.einsum("bkgtd,bksd->bkgts", q, k) * work(scale)  # (B, K, G, T, S)
    scores = softcap * np.tanh(raw / softcap) if softcap is not None else raw  # (B, K, G, T, S)
    allowed = np.ones((1, 1, T, S), dtype=bool)  # (1, 1, T, S)
    if mask is not None and mask.dtype == np.bool_:
        allowed = allowed & mask  # (B|1, H|1, T, S)
    elif mask is not None:
        scores = scores + _grouped(mask.astype(work), K, G)  # (B, K, G, T, S)
    if is_causal or window is not None:
        allowed = allowed & _band(T, S, is_causal, causal_alignment, window)
    scores = np.where(_grouped(allowed, K, G), scores, -np.inf)  # (B, K, G, T, S)
    row_max = scores.max(axis=-1, keepdims=True)  # (B, K, G, T, 1)
    row_max = np.where(np.isfinite(row_max), row_max, 0.0)  # (B, K, G, T, 1)
    p = np.exp(scores - row_max)  # (B, K, G, T, S)
    row_sum = p.sum(axis=-1, keepdims=True)  # (B, K, G, T, 1)
    weights = p / np.where(row_sum > 0, row_sum, 1.0)  # (B, K, G, T, S)
    out = np.einsum("bkgts,bkse->bkgte", weights, v)  # (B, K, G, T, E)
    d_out = d_out.reshape(B, K, G, T, E)  # (B, K, G, T, E)

    # 7'. Weighted sum, out = P·V. Each value row s was used by every query t with weight
    # P[t, s], so dV = Pᵀ·dO; the sum runs over the queries and over the G query heads that
    # share the key/value head (GQA: a shared head collects its whole group's gradient).
    d_v = np.einsum("bkgts,bkgte->bkse", weights, d_out)  # (B, K, S, E)
    # ... and each weight P[t, s] multiplied value row s, so dP = dO·Vᵀ.
    d_weights = np.einsum("bkgte,bkse->bkgts", d_out, v)  # (B, K, G, T, S)

    # 5'. Softmax: dZ = P ⊙ (dP − rowsum(dO ⊙ O)). The row sum is where the weights'
    # coupling shows: raising one score lowers every other weight of its row.
    d_row = np.sum(d_out * out, axis=-1, keepdims=True)  # (B, K, G, T, 1)
    d_scores = weights * (d_weights - d_row)  # (B, K, G, T, S)

    # 4'. Mask: a float mask was added to the scores, so its gradient is dZ itself, summed
    # over every axis along which one mask entry served many scores (broadcasting). A
    # blocked key has P = 0 and so dZ = 0: no gradient reaches it.
    d_mask = None
    if mask_dtype is not None and mask_dtype != np.bool_:
        d_full = d_scores.reshape(B, H, T, S)  # (B, H, T, S)
        d_mask = _sum_to(d_full[0] if unbatched else d_full, mask_shape)  # mask's shape
        d_mask = d_mask.astype(mask_dtype)

    # 3'. Softcap: d/dR of c·tanh(R/c) is 1 − tanh²(R/c), which fades where the cap bites.
    if softcap is not None:
        d_scores = d_scores * (1.0 - np.tanh(raw / softcap) ** 2)  # (B, K, G, T, S)

    # 2'. Scale: R = scale · q·k, so the scale multiplies the gradient on the way back.
    d_scores = d_scores * work(scale)  # (B, K, G, T, S)

    # 1'. Scores, R = q·kᵀ: dq = dR·k (a query moves towards the keys it should weigh
    # more), dk = dRᵀ·q, summed over the group's query heads as dV was.
    d_q = np.einsum("bkgts,bksd->bkgtd", d_scores, k)  # (B, K, G, T, D)
    d_q = d_q.reshape(B, H, T, D)  # (B, H, T, D)
    d_k = np.einsum("bkgts,bkgtd->bksd", d_scores, q)  # (B, K, S, D)

    grads = [d_q.astype(out_dtype), d_k.astype(out_dtype), d_v.astype(out_dtype)]
    if unbatched:
        grads = [g[0] for g in grads]
    return (*grads, d_mask) if d_mask is not None else tuple(grads)


def _check_d_out(
    d_out: np.ndarray, shape: tuple[int, int, int, int], dtype: np.dtype, unbatched: bool
) -> None:
    want = shape[1:] if unbatched else shape
    got = d_out.shape[1:] if unbatched else d_out.shape
    letters = "(H, T, E)" if unbatched else "(B, H, T, E)"
    if got != want:
        raise ValueError(f"d_out shape should be the output's {letters} = {want}, got {got}")
    if d_out.dtype != dtype:
        raise TypeError(f"d_out dtype should be {dtype} like q, got {d_out.dtype}")


def _sum_to(x: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """Undo broadcasting: sum x over the axes along which an array of ``shape`` was broadcast."""
    x = x.sum(axis=tuple(range(x.ndim - len(shape))))  # drop the leading axes
    axes = tuple(i for i, n in enumerate(shape) if n == 1 and x.shape[i] != 1)
    return x.sum(axis=axes, keepdims=True).reshape(shape)


def linear_backward(
    x: np.ndarray, weight: np.ndarray, d_y: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Gradients of y = x Wᵀ + b: (dx, dW, db) for x (..., in), W (out, in), dy (..., out)."""
    d_x = d_y @ weight  # (..., in)
    d_weight = d_y.reshape(-1, d_y.shape[-1]).T @ x.reshape(-1, x.shape[-1])  # (out, in)
    d_bias = d_y.reshape(-1, d_y.shape[-1]).sum(axis=0)  # (out,)
    return d_x, d_weight, d_bias


def layer_norm_backward(
    x: np.ndarray, weight: np.ndarray, d_y: np.ndarray, eps: float = 1e-5
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Gradients of ``layer_norm``: (dx, dweight, dbias) for x, dy (..., C).

    With x̂ = (x − mean) / σ, y = x̂·w + b: the gradient reaching x̂ is dx̂ = dy·w, and
    because the mean and σ depend on every x of the row, dx = (dx̂ − mean(dx̂) −
    x̂·mean(dx̂·x̂)) / σ: the part of dx̂ that would shift or stretch the row is removed.
    """
    mean = x.mean(axis=-1, keepdims=True)  # (..., 1)
    sigma = np.sqrt(((x - mean) ** 2).mean(axis=-1, keepdims=True) + eps)  # (..., 1)
    x_hat = (x - mean) / sigma  # (..., C)
    d_x_hat = d_y * weight  # (..., C)
    d_x = (
        d_x_hat
        - d_x_hat.mean(axis=-1, keepdims=True)
        - x_hat * (d_x_hat * x_hat).mean(axis=-1, keepdims=True)
    ) / sigma  # (..., C)
    rows = d_y.reshape(-1, d_y.shape[-1])  # (N, C)
    d_weight = (rows * x_hat.reshape(rows.shape)).sum(axis=0)  # (C,)
    return d_x, d_weight, rows.sum(axis=0)


def gelu_backward(x: np.ndarray, d_y: np.ndarray) -> np.ndarray:
    """Gradient of the exact GELU, x·Φ(x): dy · (Φ(x) + x·φ(x))."""
    erf = np.vectorize(math.erf, otypes=[np.float64])
    cdf = 0.5 * (1.0 + erf(x / math.sqrt(2.0)))  # Φ(x)
    pdf = np.exp(-0.5 * x.astype(np.float64) ** 2) / math.sqrt(2.0 * math.pi)  # φ(x)
    return (d_y * (cdf + x * pdf)).astype(x.dtype)


def multi_head_attention_backward(
    params: dict[str, np.ndarray],
    x: np.ndarray,
    d_out: np.ndarray,
    *,
    n_heads: int,
    mask: np.ndarray | None = None,
    is_causal: bool = False,
) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Gradients of ``multi_head_attention``: (dx, {parameter name: gradient}).

    The forward's four steps in reverse: out_proj, merge heads, attention, split heads and
    the fused projection. A float mask's gradient is not returned (it is no parameter).
    """
    x = np.asarray(x)
    B, T, C = x.shape
    H = n_heads
    if not isinstance(H, int) or H <= 0 or C % H != 0:
        raise ValueError(f"n_heads H={H} should be a positive int dividing the model width C={C}")
    D = C // H

    # Forward steps 1-3 again, keeping their inputs.
    qkv = linear(x, params["qkv.weight"], params["qkv.bias"])  # (B, T, 3C)
    q, k, v = (
        part.reshape(B, T, H, D).transpose(0, 2, 1, 3) for part in np.split(qkv, 3, axis=-1)
    )  # 3 × (B, H, T, D)
    context = attention(q, k, v, mask=mask, is_causal=is_causal)  # (B, H, T, D)
    context = context.transpose(0, 2, 1, 3).reshape(B, T, C)  # (B, T, C)

    # 4'. out_proj, then un-merge the heads: the merge was a reshape, so is its gradient.
    d_context, d_w_out, d_b_out = linear_backward(context, params["out_proj.weight"], d_out)
    d_context = d_context.reshape(B, T, H, D).transpose(0, 2, 1, 3)  # (B, H, T, D)

    # 3'. Attention in every head at once.
    grads = attention_backward(q, k, v, d_context, mask=mask, is_causal=is_causal)
    d_q, d_k, d_v = grads[:3]  # 3 × (B, H, T, D)

    # 2'. and 1'. Heads back into the width, q, k, v side by side, then the projection.
    d_qkv = np.concatenate(
        [g.transpose(0, 2, 1, 3).reshape(B, T, C) for g in (d_q, d_k, d_v)], axis=-1
    )  # (B, T, 3C)
    d_x, d_w_qkv, d_b_qkv = linear_backward(x, params["qkv.weight"], d_qkv)
    return d_x, {
        "qkv.weight": d_w_qkv,
        "qkv.bias": d_b_qkv,
        "out_proj.weight": d_w_out,
        "out_proj.bias": d_b_out,
    }


def gpt_block_backward(
    params: dict[str, np.ndarray], x: np.ndarray, d_out: np.ndarray, *, n_heads: int
) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Gradients of ``gpt_block``: (dx, {parameter name: gradient}).

    Each residual connection x + f(x) passes the gradient straight through and adds f's
    backward, which is why deep pre-LN stacks keep their gradients alive.
    """
    attn = {name[5:]: p for name, p in params.items() if name.startswith("attn.")}
    # Forward again, keeping every sublayer's input.
    h1 = layer_norm(x, params["norm1.weight"], params["norm1.bias"])  # (B, T, C)
    x1 = x + multi_head_attention(attn, h1, n_heads=n_heads, is_causal=True)  # (B, T, C)
    h2 = layer_norm(x1, params["norm2.weight"], params["norm2.bias"])  # (B, T, C)
    u = linear(h2, params["mlp.0.weight"], params["mlp.0.bias"])  # (B, T, F)
    g = gelu(u)  # (B, T, F)

    # MLP sublayer: out = x1 + mlp(norm2(x1)).
    d_g, d_w2, d_b2 = linear_backward(g, params["mlp.2.weight"], d_out)  # d_g (B, T, F)
    d_u = gelu_backward(u, d_g)  # (B, T, F)
    d_h2, d_w1, d_b1 = linear_backward(h2, params["mlp.0.weight"], d_u)  # d_h2 (B, T, C)
    d_x1, d_n2w, d_n2b = layer_norm_backward(x1, params["norm2.weight"], d_h2)
    d_x1 = d_out + d_x1  # (B, T, C)

    # Attention sublayer: x1 = x + mha(norm1(x)).
    d_h1, d_attn = multi_head_attention_backward(attn, h1, d_x1, n_heads=n_heads, is_causal=True)
    d_x, d_n1w, d_n1b = layer_norm_backward(x, params["norm1.weight"], d_h1)
    d_x = d_x1 + d_x  # (B, T, C)
    return d_x, {
        **{f"attn.{name}": grad for name, grad in d_attn.items()},
        "norm1.weight": d_n1w,
        "norm1.bias": d_n1b,
        "norm2.weight": d_n2w,
        "norm2.bias": d_n2b,
        "mlp.0.weight": d_w1,
        "mlp.0.bias": d_b1,
        "mlp.2.weight": d_w2,
        "mlp.2.bias": d_b2,
    }
