"""Deliberately broken NumPy attention backends: the suite must fail every one of them.

Each mutant is the reference algorithm of ``impls/numpy_attention.py`` with exactly one
step replaced by a small broken function. The steps are plain module-level functions;
a mutant backend names the one it swaps out. Input validation is borrowed from the
reference so that a mutant differs from it only in the one broken step.

``MUTANTS`` maps a mutant's backend name to ``(backend class, expected clauses,
node substring)``: the suite must fail that backend with at least one failing test that
carries one of the expected clauses (and, when given, whose node id contains the
substring).
"""

from __future__ import annotations

import math

import numpy as np

from conformance.backends import ALL_CAPABILITIES, DTYPES, Backend
from impls.numpy_attention import (
    _check_inputs,
    _check_mask,
    _check_options,
    gelu,
    layer_norm,
    linear,
)

# --- The correct steps ---------------------------------------------------------------------


def default_scale(D, scale):
    """1/√D unless a scale is given."""
    return 1.0 / math.sqrt(D) if scale is None else scale


def expand_kv(x, G):
    """(B, K, S, ·) -> (B, H, S, ·): key/value head κ serves query heads κ·G .. κ·G + G - 1."""
    return np.repeat(x, G, axis=1)


def apply_float_mask(scores, mask):
    """A float mask is added to the scores."""
    return scores + mask


def bool_allowed(mask):
    """A bool mask is True where the query may attend."""
    return mask


def band(T, S, is_causal, causal_alignment, window):
    """Which keys each query may see under causality and the window: (T, S) bool."""
    offset = 0 if causal_alignment == "top_left" else S - T
    distance = np.arange(S)[None, :] - (np.arange(T)[:, None] + offset)
    allowed = np.ones((T, S), dtype=bool)
    if is_causal:
        allowed &= distance <= 0
    if window is not None:
        left, right = window
        if left is not None:
            allowed &= distance >= -left
        if right is not None:
            allowed &= distance <= right
    return allowed


def softmax(scores, dtype):
    """Stable softmax over the keys; a row with every key at -inf gets weights 0."""
    row_max = scores.max(axis=-1, keepdims=True)
    row_max = np.where(np.isfinite(row_max), row_max, 0.0)
    p = np.exp(scores - row_max)
    row_sum = p.sum(axis=-1, keepdims=True)
    return p / np.where(row_sum > 0, row_sum, 1.0)


def dropout(weights, p, rng):
    """Zero each weight with probability p; scale the survivors by 1 / (1 - p)."""
    keep = rng.random(weights.shape) >= p
    return weights * keep / (1.0 - p)


def cast_output(out, dtype):
    """The output has the inputs' dtype."""
    return out.astype(dtype)


def merge_heads(context):
    """(B, H, T, D) -> (B, T, C), head-major: head h owns channels [h·D, (h+1)·D)."""
    B, H, T, D = context.shape
    return context.transpose(0, 2, 1, 3).reshape(B, T, H * D)


# --- The broken steps ----------------------------------------------------------------------


def scale_one_over_d(D, scale):
    """BUG: 1/D instead of 1/√D by default."""
    return 1.0 / D if scale is None else scale


def scale_none(D, scale):
    """BUG: the scores are never scaled, whatever scale is asked for."""
    return 1.0


def softmax_wrong_axis(scores, dtype):
    """BUG: normalises over the queries (axis -2) instead of the keys."""
    row_max = scores.max(axis=-2, keepdims=True)
    row_max = np.where(np.isfinite(row_max), row_max, 0.0)
    p = np.exp(scores - row_max)
    row_sum = p.sum(axis=-2, keepdims=True)
    return p / np.where(row_sum > 0, row_sum, 1.0)


def band_causal_off_by_one(T, S, is_causal, causal_alignment, window):
    """BUG: causal keeps s < t, dropping the diagonal."""
    allowed = band(T, S, False, causal_alignment, window)
    if is_causal:
        offset = 0 if causal_alignment == "top_left" else S - T
        allowed &= np.arange(S)[None, :] < np.arange(T)[:, None] + offset
    return allowed


def band_always_bottom_right(T, S, is_causal, causal_alignment, window):
    """BUG: bottom-right alignment even when top-left is asked."""
    return band(T, S, is_causal, "bottom_right", window)


def band_always_top_left(T, S, is_causal, causal_alignment, window):
    """BUG: top-left alignment even when bottom-right is asked."""
    return band(T, S, is_causal, "top_left", window)


def expand_kv_tile(x, G):
    """BUG: tiles the key/value heads (κ = h % K) instead of repeat_interleave (κ = h // G)."""
    return np.tile(x, (1, G, 1, 1))


def softmax_no_max_subtraction(scores, dtype):
    """BUG: exp of the raw scores, which overflows for large logits."""
    with np.errstate(over="ignore", invalid="ignore"):
        p = np.exp(scores)
        row_sum = p.sum(axis=-1, keepdims=True)
        return p / np.where(row_sum > 0, row_sum, 1.0)


def softmax_nan_rows(scores, dtype):
    """BUG: the textbook softmax: a fully masked row is exp(-inf - -inf) = NaN."""
    with np.errstate(invalid="ignore"):
        p = np.exp(scores - scores.max(axis=-1, keepdims=True))
        return p / p.sum(axis=-1, keepdims=True)


def softmax_mean_rows(scores, dtype):
    """BUG: a fully masked row gets uniform weights, i.e. the mean of V (as JAX does)."""
    weights = softmax(scores, dtype)
    empty = np.isneginf(scores).all(axis=-1, keepdims=True)
    return np.where(empty, 1.0 / scores.shape[-1], weights)


def bool_allowed_flipped(mask):
    """BUG: a bool mask's True means "blocked"."""
    return ~mask


def float_mask_multiplied(scores, mask):
    """BUG: the float mask multiplies the scores instead of being added."""
    with np.errstate(invalid="ignore"):
        return scores * mask


def dropout_never(weights, p, rng):
    """BUG: ignores p, never drops anything."""
    return weights


def softmax_float16_sum(scores, dtype):
    """BUG: for float16 inputs the exponentials are summed in float16."""
    row_max = scores.max(axis=-1, keepdims=True)
    row_max = np.where(np.isfinite(row_max), row_max, 0.0)
    p = np.exp(scores - row_max)
    if dtype == np.float16:
        # One running float16 total, key after key, as a loop or a kernel would keep it.
        row_sum = np.cumsum(p.astype(np.float16), axis=-1, dtype=np.float16)[..., -1:]
        row_sum = row_sum.astype(p.dtype)
    else:
        row_sum = p.sum(axis=-1, keepdims=True)
    return p / np.where(row_sum > 0, row_sum, 1.0)


def cast_output_float64(out, dtype):
    """BUG: the output is always float64."""
    return out.astype(np.float64)


def merge_heads_wrong_order(context):
    """BUG: merges the heads channel-major, (B, T, D, H) before the reshape."""
    B, H, T, D = context.shape
    return context.transpose(0, 2, 3, 1).reshape(B, T, H * D)


# --- The algorithm, step by step -----------------------------------------------------------


class Steps:
    """The reference algorithm; a mutant replaces one of these staticmethods."""

    scale_for = staticmethod(default_scale)
    expand_kv = staticmethod(expand_kv)
    apply_float_mask = staticmethod(apply_float_mask)
    bool_allowed = staticmethod(bool_allowed)
    band = staticmethod(band)
    softmax = staticmethod(softmax)
    dropout = staticmethod(dropout)
    cast_output = staticmethod(cast_output)
    merge_heads = staticmethod(merge_heads)

    def run(
        self,
        q,
        k,
        v,
        *,
        mask=None,
        is_causal=False,
        scale=None,
        causal_alignment="top_left",
        window=None,
        softcap=None,
        dropout_p=0.0,
        rng=None,
    ):
        q, k, v = np.asarray(q), np.asarray(k), np.asarray(v)
        _check_inputs(q, k, v)
        unbatched = q.ndim == 3
        if unbatched:
            q, k, v = q[None], k[None], v[None]
        B, H, T, D = q.shape
        _, K, S, _ = k.shape
        G = H // K
        mask = _check_mask(mask, (B, H, T, S), unbatched)  # (B|1, H|1, T, S)
        _check_options(D, scale, is_causal, causal_alignment, window, softcap, dropout_p, rng)
        scale = self.scale_for(D, scale)

        dtype = q.dtype
        work = np.float64 if dtype == np.float64 else np.float32
        q, k, v = q.astype(work), k.astype(work), v.astype(work)
        k, v = self.expand_kv(k, G), self.expand_kv(v, G)  # (B, H, S, ·)

        scores = np.einsum("bhtd,bhsd->bhts", q, k) * work(scale)  # (B, H, T, S)
        if softcap is not None:
            scores = softcap * np.tanh(scores / softcap)
        allowed = np.ones((1, 1, T, S), dtype=bool)
        if mask is not None and mask.dtype == np.bool_:
            allowed = allowed & self.bool_allowed(mask)
        elif mask is not None:
            scores = self.apply_float_mask(scores, mask.astype(work))
        if is_causal or window is not None:
            allowed = allowed & self.band(T, S, is_causal, causal_alignment, window)
        scores = np.where(allowed, scores, -np.inf)  # (B, H, T, S)

        weights = self.softmax(scores, dtype)  # (B, H, T, S)
        if dropout_p > 0:
            weights = self.dropout(weights, dropout_p, rng)
        out = self.cast_output(np.einsum("bhts,bhse->bhte", weights, v), dtype)
        return out[0] if unbatched else out

    def multi_head_attention(self, params, x, *, n_heads, mask=None, is_causal=False):
        x = np.asarray(x)
        B, T, C = x.shape
        H = n_heads
        if not isinstance(H, int) or H <= 0 or C % H != 0:
            raise ValueError(
                f"n_heads H={H} should be a positive int dividing the model width C={C}"
            )
        D = C // H
        qkv = linear(x, params["qkv.weight"], params["qkv.bias"])  # (B, T, 3C)
        q, k, v = (
            part.reshape(B, T, H, D).transpose(0, 2, 1, 3) for part in np.split(qkv, 3, axis=-1)
        )  # 3 × (B, H, T, D)
        context = self.run(q, k, v, mask=mask, is_causal=is_causal)  # (B, H, T, D)
        context = self.merge_heads(context)  # (B, T, C)
        return linear(context, params["out_proj.weight"], params["out_proj.bias"])

    def gpt_block(self, params, x, *, n_heads):
        attn = {name[5:]: p for name, p in params.items() if name.startswith("attn.")}
        h = layer_norm(x, params["norm1.weight"], params["norm1.bias"])
        x = x + self.multi_head_attention(attn, h, n_heads=n_heads, is_causal=True)
        h = layer_norm(x, params["norm2.weight"], params["norm2.bias"])
        h = gelu(linear(h, params["mlp.0.weight"], params["mlp.0.bias"]))
        return x + linear(h, params["mlp.2.weight"], params["mlp.2.bias"])


class MutantBackend(Backend):
    """A NumPy backend running ``steps``; declares what the numpy backend declares."""

    capabilities = ALL_CAPABILITIES - {"module"}
    dtypes = DTYPES
    steps: type[Steps] = Steps

    def _attention(self, q, k, v, *, seed=None, **options):
        if seed is not None:
            options["rng"] = np.random.default_rng(seed)
        return self.steps().run(q, k, v, **options)


class ModuleMutantBackend(MutantBackend):
    capabilities = ALL_CAPABILITIES

    def multi_head_attention(self, params, x, *, n_heads, mask=None, is_causal=False):
        return self.steps().multi_head_attention(
            params, x, n_heads=n_heads, mask=mask, is_causal=is_causal
        )

    def gpt_block(self, params, x, *, n_heads):
        return self.steps().gpt_block(params, x, n_heads=n_heads)


def _mutant(name, step, broken, base=MutantBackend):
    """A backend class whose ``Steps`` has ``step`` replaced by ``broken``."""
    steps = type(f"Steps_{broken.__name__}", (Steps,), {step: staticmethod(broken)})
    return type(f"Mutant_{broken.__name__}", (base,), {"name": name, "steps": steps})


#: The unbroken algorithm, as a control: the suite must pass it.
Control = type("MutantControl", (ModuleMutantBackend,), {"name": "mutant-control"})

#: name: (backend class, clauses that should catch it, substring the failing node id needs)
MUTANTS = {
    "mutant-scale-1-over-d": (
        _mutant("mutant-scale-1-over-d", "scale_for", scale_one_over_d),
        {"4.1", "11.1"},
        "",
    ),
    "mutant-no-scale": (
        _mutant("mutant-no-scale", "scale_for", scale_none),
        {"4.1", "11.1"},
        "",
    ),
    "mutant-softmax-wrong-axis": (
        _mutant("mutant-softmax-wrong-axis", "softmax", softmax_wrong_axis),
        {"4.1", "6.2", "11.1"},
        "",
    ),
    "mutant-causal-off-by-one": (
        _mutant("mutant-causal-off-by-one", "band", band_causal_off_by_one),
        {"3.4", "6.3"},
        "",
    ),
    "mutant-bottom-right-for-top-left": (
        _mutant("mutant-bottom-right-for-top-left", "band", band_always_bottom_right),
        {"3.4", "6.2", "6.3"},
        "",
    ),
    "mutant-top-left-for-bottom-right": (
        _mutant("mutant-top-left-for-bottom-right", "band", band_always_top_left),
        {"3.5", "6.11"},
        "",
    ),
    "mutant-gqa-tile": (
        _mutant("mutant-gqa-tile", "expand_kv", expand_kv_tile),
        {"4.6", "6.12"},
        "",
    ),
    "mutant-no-max-subtraction": (
        _mutant("mutant-no-max-subtraction", "softmax", softmax_no_max_subtraction),
        {"4.4", "6.7"},
        "",
    ),
    "mutant-nan-masked-rows": (
        _mutant("mutant-nan-masked-rows", "softmax", softmax_nan_rows),
        {"4.3"},
        "",
    ),
    "mutant-mean-masked-rows": (
        _mutant("mutant-mean-masked-rows", "softmax", softmax_mean_rows),
        {"4.3"},
        "",
    ),
    "mutant-mask-polarity": (
        _mutant("mutant-mask-polarity", "bool_allowed", bool_allowed_flipped),
        {"3.1", "6.4"},
        "",
    ),
    "mutant-float-mask-multiplied": (
        _mutant("mutant-float-mask-multiplied", "apply_float_mask", float_mask_multiplied),
        {"3.2", "6.4"},
        "",
    ),
    "mutant-dropout-never": (
        _mutant("mutant-dropout-never", "dropout", dropout_never),
        {"5.2"},
        "",
    ),
    "mutant-float16-sum": (
        _mutant("mutant-float16-sum", "softmax", softmax_float16_sum),
        {"7.1", "4.5"},
        "float16",
    ),
    "mutant-output-float64": (
        _mutant("mutant-output-float64", "cast_output", cast_output_float64),
        {"2.4", "6.1"},
        "",
    ),
    "mutant-heads-merged-wrong": (
        _mutant(
            "mutant-heads-merged-wrong",
            "merge_heads",
            merge_heads_wrong_order,
            base=ModuleMutantBackend,
        ),
        {"9.1", "9.2"},
        "",
    ),
}
