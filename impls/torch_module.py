"""Multi-head attention and a pre-LN GPT block as PyTorch modules, with their own core.

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

Shape legend (heads-first, as in PyTorch; PyTorch's own docs call T "L" and E "Ev"):

    B batch            H query heads      K key/value heads (H % K == 0)
    G = H // K         T query length     S key/value length
    D q/k head dim     E v head dim       C model width (module only)
    F MLP hidden width (block only)

    q (B, H, T, D)    k (B, K, S, D)    v (B, K, S, E)    out (B, H, T, E)
    mask: bool (True = may attend) or floating (added to the scores),
          broadcastable to (B, H, T, S)

Unbatched inputs q (H, T, D), k (K, S, D), v (K, S, E) give out (H, T, E).

Supports: bool and float masks, causal masking aligned top-left or bottom-right, sliding
windows, softcapping, grouped-query and multi-query attention (K < H), dropout on the
weights (through a callable such as ``nn.Dropout``, so that ``module.eval()`` turns it
off), float64, float32, float16 and bfloat16, autograd. A query row with no key left to
attend returns exactly 0, and its gradients are 0, not NaN. Float16 and bfloat16 inputs
are computed in float32 and the result rounded once.

The dropout callable receives the (B, H, T, S) weights in the compute dtype. An
``nn.Dropout`` in training mode runs ``at::dropout``, the very call SDPA's math backend
makes, so after ``torch.manual_seed(s)`` it drops the same positions as
``F.scaled_dot_product_attention(..., dropout_p=p)`` with the same seed.

The modules are the seed tutorial's: ``MultiHeadAttention`` (one fused ``qkv`` Linear,
``out_proj``, ``dropout``) and the pre-LN ``SelfAttentionBlock``. Their ``state_dict``
names are the parameter names of the NumPy reference's ``multi_head_attention`` and
``gpt_block``.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

ALIGNMENTS = ("top_left", "bottom_right")


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    mask: torch.Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    causal_alignment: str = "top_left",
    window: tuple[int | None, int | None] | None = None,
    softcap: float | None = None,
    dropout: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """Scaled dot-product attention: the core of ``MultiHeadAttention``.

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
      dropout: applied to the (B, H, T, S) weights, e.g. ``nn.Dropout(p)``: zeroes each
        weight with probability p in training mode, does nothing in eval mode.

    Returns:
      out: (B, H, T, E), or (H, T, E) for unbatched input; same dtype as q.
    """
    # 0. Validate: every problem is reported with the argument's name, the expected shape
    # in letters and numbers, and what was given.
    q, k, v = torch.as_tensor(q), torch.as_tensor(k), torch.as_tensor(v)
    _check_inputs(q, k, v)
    unbatched = q.ndim == 3
    if unbatched:
        q, k, v = q[None], k[None], v[None]
    B, H, T, D = q.shape
    _, K, S, _ = k.shape
    E = v.shape[-1]
    G = H // K
    mask = _check_mask(mask, (B, H, T, S), unbatched)
    scale = _check_options(D, scale, is_causal, causal_alignment, window, softcap, dropout)

    # Low precision inputs are computed in float32: exp() of a float16 score overflows
    # past 11.09, and summing many weights in float16 loses the small ones.
    out_dtype = q.dtype
    work = torch.float64 if out_dtype == torch.float64 else torch.float32
    q, k, v = q.to(work), k.to(work), v.to(work)

    # 1. Scores: every query against every key of its group's key/value head. Query head
    # h = k·G + g shares key/value head k (PyTorch's repeat_interleave, not tiling).
    q = q.reshape(B, K, G, T, D)  # (B, K, G, T, D)
    scores = torch.einsum("bkgtd,bksd->bkgts", q, k)  # (B, K, G, T, S)

    # 2. Scale, so that the scores' spread does not grow with the head size D.
    scores = scores * scale  # (B, K, G, T, S)

    # 3. Softcap: squash the scores smoothly into (-softcap, softcap).
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)  # (B, K, G, T, S)

    # 4. Mask: a float mask is added; a bool mask, the causal triangle and the window
    # decide which keys each query may see at all.
    allowed = q.new_ones((1, 1, T, S), dtype=torch.bool)  # (1, 1, T, S)
    if mask is not None and mask.dtype == torch.bool:
        allowed = allowed & mask  # (B|1, H|1, T, S)
    elif mask is not None:
        scores = scores + _grouped(mask.to(work), K, G)  # (B, K, G, T, S)
    if is_causal or window is not None:
        allowed = allowed & _band(T, S, is_causal, causal_alignment, window, q.device)
    scores = torch.where(_grouped(allowed, K, G), scores, -math.inf)  # (B, K, G, T, S)

    # 5. Softmax over the keys. Subtracting the row maximum keeps exp() <= 1, so large
    # scores cannot overflow. A row with every key blocked has max -inf; it is given
    # weights of exactly 0 (as PyTorch SDPA and FlashAttention do) instead of
    # the NaN that exp(-inf - -inf) would give.
    row_max = scores.amax(dim=-1, keepdim=True)  # (B, K, G, T, 1)
    row_max = torch.where(torch.isfinite(row_max), row_max, 0.0)  # (B, K, G, T, 1)
    p = torch.exp(scores - row_max)  # (B, K, G, T, S)
    row_sum = p.sum(dim=-1, keepdim=True)  # (B, K, G, T, 1)
    weights = p / torch.where(row_sum > 0, row_sum, 1.0)  # (B, K, G, T, S)

    # 6. Dropout: zero each weight with probability dropout_p and rescale the survivors
    # by 1 / (1 - dropout_p), so the expected output is unchanged.
    if dropout is not None:
        # The callable sees the weights as (B, H, T, S), the shape SDPA's math backend
        # hands to at::dropout, so an nn.Dropout draws its mask in the same order.
        weights = dropout(weights.reshape(B, H, T, S))  # (B, H, T, S)
        weights = weights.reshape(B, K, G, T, S)  # (B, K, G, T, S)

    # 7. Weighted sum of the values, then the query heads back in order h = k·G + g.
    out = torch.einsum("bkgts,bkse->bkgte", weights, v)  # (B, K, G, T, E)
    out = out.reshape(B, H, T, E).to(out_dtype)  # (B, H, T, E)
    return out[0] if unbatched else out


def _grouped(x: torch.Tensor, K: int, G: int) -> torch.Tensor:
    """Broadcast a (B|1, H|1, T, S) tensor onto the grouped layout (B|1, K|1, G|1, T, S)."""
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
    device: torch.device,
) -> torch.Tensor:
    """Which keys each query may see under causality and the window: (1, 1, T, S) bool."""
    # Query t's diagonal is key t (top-left) or key t + S - T (bottom-right, so that the
    # last query lines up with the last key).
    offset = 0 if causal_alignment == "top_left" else S - T
    t = torch.arange(T, device=device)[:, None]  # (T, 1)
    s = torch.arange(S, device=device)[None, :]  # (1, S)
    distance = s - (t + offset)  # (T, S)
    allowed = torch.ones((T, S), dtype=torch.bool, device=device)  # (T, S)
    if is_causal:
        allowed &= distance <= 0
    if window is not None:
        left, right = window
        if left is not None:
            allowed &= distance >= -left
        if right is not None:
            allowed &= distance <= right
    return allowed[None, None]  # (1, 1, T, S)


def _dtype_name(dtype: torch.dtype) -> str:
    # "float16", not "torch.float16": messages read the same as the NumPy reference's.
    return str(dtype).removeprefix("torch.")


def _check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if q.ndim not in (3, 4):
        raise ValueError(
            f"q should have rank 4 (B, H, T, D) or 3 (H, T, D), got rank {q.ndim} "
            f"with shape {tuple(q.shape)}"
        )
    letters = "(B, K, S, D)" if q.ndim == 4 else "(K, S, D)"
    for name, x in (("k", k), ("v", v)):
        if x.ndim != q.ndim:
            raise ValueError(
                f"{name} should have rank {q.ndim} {letters} like q, got rank {x.ndim} "
                f"with shape {tuple(x.shape)}"
            )
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not x.dtype.is_floating_point:
            raise TypeError(f"{name} should be a floating tensor, got dtype {_dtype_name(x.dtype)}")
    for name, x in (("k", k), ("v", v)):
        if x.dtype != q.dtype:
            raise TypeError(
                f"{name} dtype should be {_dtype_name(q.dtype)} like q, got {_dtype_name(x.dtype)}"
            )
    q4, k4, v4 = (x if x.ndim == 4 else x[None] for x in (q, k, v))
    B, H, _, D = q4.shape
    _, K, S, _ = k4.shape
    E = v4.shape[-1]
    batch = "B, " if q.ndim == 4 else ""
    drop = 0 if q.ndim == 4 else 1
    if K == 0 or H % K != 0:
        raise ValueError(
            f"k heads K={K} should divide q heads H={H} (grouped-query attention shares "
            f"each key/value head among H // K query heads), got k shape {tuple(k.shape)}"
        )
    want_k = (B, K, S, D)[drop:]
    if tuple(k.shape) != want_k:
        raise ValueError(
            f"k shape should be ({batch}K, S, D) = {want_k} to match q {tuple(q.shape)}, "
            f"got {tuple(k.shape)}"
        )
    want_v = (B, K, S, E)[drop:]
    if tuple(v.shape[:-1]) != want_v[:-1]:
        raise ValueError(
            f"v shape should be ({batch}K, S, E) = {want_v} to match k {tuple(k.shape)}, "
            f"got {tuple(v.shape)}"
        )


def _check_mask(
    mask: torch.Tensor | None, shape: tuple[int, int, int, int], unbatched: bool
) -> torch.Tensor | None:
    """Return the mask as a (B|1, H|1, T, S) tensor, or None."""
    if mask is None:
        return None
    mask = torch.as_tensor(mask)
    if mask.dtype != torch.bool and not mask.dtype.is_floating_point:
        raise TypeError(
            f"mask dtype should be bool (True = may attend) or floating (added to the "
            f"scores), got {_dtype_name(mask.dtype)}: an integer mask is ambiguous"
        )
    want = shape[1:] if unbatched else shape
    letters = "(H, T, S)" if unbatched else "(B, H, T, S)"
    try:
        fits = mask.ndim <= len(want) and tuple(torch.broadcast_shapes(mask.shape, want)) == want
    except RuntimeError:
        fits = False
    if not fits:
        raise ValueError(
            f"mask shape should broadcast to {letters} = {want}, got {tuple(mask.shape)}"
        )
    mask = mask.reshape((1,) * (4 - mask.ndim) + mask.shape)  # (B|1, H|1, T|1, S|1)
    _, _, T, S = shape
    b, h = mask.shape[0], mask.shape[1]
    return mask.expand(b, h, T, S)  # (B|1, H|1, T, S)


def _check_options(
    D: int,
    scale: float | None,
    is_causal: bool,
    causal_alignment: str,
    window: tuple[int | None, int | None] | None,
    softcap: float | None,
    dropout: Callable[[torch.Tensor], torch.Tensor] | None,
) -> float:
    """Check the keyword options; return the scale to use."""
    if not isinstance(is_causal, bool):
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
    if dropout is not None and not callable(dropout):
        raise TypeError(
            f"dropout should be a callable such as nn.Dropout, or None, got {dropout!r}"
        )
    # nn.Dropout accepts p = 1 (every weight dropped); the contract, like SDPA's rescale
    # by 1 / (1 - p), needs p < 1.
    dropout_p = getattr(dropout, "p", 0.0)
    if not (isinstance(dropout_p, (int, float)) and 0.0 <= dropout_p < 1.0):
        raise ValueError(f"dropout_p (dropout.p) should be a float in [0, 1), got {dropout_p!r}")
    if scale is None:
        return 1.0 / math.sqrt(D)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale should be a positive float or None, got {scale!r}")
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale should be a positive finite float, got {scale!r}")
    return float(scale)


class MultiHeadAttention(nn.Module):
    """Multi-head self-attention: one fused q/k/v projection, H heads, an output mix.

    Args:
      d_model: C, the model width.
      n_heads: H, which must divide C; each head has D = C // H channels.
      dropout: probability of zeroing each attention weight in training mode.

    Shapes: x (B, T, C) -> (B, T, C).
    """

    def __init__(self, d_model: int, n_heads: int, dropout: float = 0.0) -> None:
        super().__init__()
        C, H = d_model, n_heads
        if not isinstance(H, int) or H <= 0 or C % H != 0:
            raise ValueError(
                f"n_heads H={H} should be a positive int dividing the model width C={C}"
            )
        if not (isinstance(dropout, (int, float)) and 0.0 <= dropout < 1.0):
            raise ValueError(f"dropout should be a float in [0, 1), got {dropout!r}")
        self.d_model = C
        self.n_heads = H
        self.head_dim = C // H
        self.qkv = nn.Linear(C, 3 * C)
        self.out_proj = nn.Linear(C, C)
        self.dropout = nn.Dropout(dropout)

    def forward(
        self,
        x: torch.Tensor,
        mask: torch.Tensor | None = None,
        is_causal: bool = False,
    ) -> torch.Tensor:
        """Attend every position of x to the others (mask, is_causal as ``attention``)."""
        if x.ndim != 3 or x.shape[-1] != self.d_model:
            raise ValueError(
                f"x shape should be (B, T, C) with C = d_model = {self.d_model}, "
                f"got {tuple(x.shape)}"
            )
        B, T, C = x.shape
        H, D = self.n_heads, self.head_dim

        # 1. Project to queries, keys and values with one fused matrix, then split them.
        qkv = self.qkv(x)  # (B, T, 3C)
        q, k, v = qkv.split(C, dim=-1)  # 3 × (B, T, C)

        # 2. Split the width into H heads of D channels: head h owns channels [h·D, (h+1)·D).
        q = q.reshape(B, T, H, D).transpose(1, 2)  # (B, H, T, D)
        k = k.reshape(B, T, H, D).transpose(1, 2)  # (B, H, T, D)
        v = v.reshape(B, T, H, D).transpose(1, 2)  # (B, H, T, D)

        # 3. Attention in every head at once; the dropout module is off in eval mode.
        context = attention(
            q, k, v, mask=mask, is_causal=is_causal, dropout=self.dropout
        )  # (B, H, T, D)

        # 4. Merge the heads back into the width, head-major, then mix them.
        context = context.transpose(1, 2).reshape(B, T, C)  # (B, T, C)
        return self.out_proj(context)  # (B, T, C)


class SelfAttentionBlock(nn.Module):
    """One pre-LN decoder block: x + attn(norm1(x)), then + mlp(norm2(x)).

    Args:
      d_model: C, the model width.
      n_heads: H, which must divide C.
      d_ff: F, the MLP's hidden width.

    Shapes: x (B, T, C) -> (B, T, C). The attention is causal (top-left, T = S).
    """

    def __init__(self, d_model: int, n_heads: int, d_ff: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(d_model)
        self.attn = MultiHeadAttention(d_model, n_heads)
        self.norm2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, d_ff),
            nn.GELU(),
            nn.Linear(d_ff, d_model),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Pre-LN: each sublayer sees a normalised input, and the residual path stays an
        # identity, which keeps deep stacks trainable without warm-up tricks.
        x = x + self.attn(self.norm1(x), is_causal=True)  # (B, T, C)
        return x + self.mlp(self.norm2(x))  # (B, T, C)
