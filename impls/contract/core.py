"""The check of one attention call: q, k, v, the mask and every option (SPEC §8)."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any

from .numbers import (
    check_bool,
    check_chunk_size,
    check_softcap,
    check_window,
    dtype_name,
    integer,
    is_floating,
    positive,
    probability,
    scalar,
)

ALIGNMENTS = ("top_left", "bottom_right")


@dataclass(frozen=True)
class Checked:
    """What the contract found: the sizes, and the options in their normal form.

    ``mask_shape`` is the mask's shape with leading 1s up to rank 4, (B|1, H|1, T|1, S|1),
    so that after ``mask.reshape(mask_shape)`` it broadcasts against the (B, H, T, S)
    scores of a batched call; ``mask_is_bool`` tells a bool mask (which keys may be
    attended) from a floating one (added to the scores).
    """

    unbatched: bool
    B: int
    H: int
    K: int
    G: int
    T: int
    S: int
    D: int
    E: int
    mask_shape: tuple[int, int, int, int] | None
    mask_is_bool: bool
    is_causal: bool
    scale: float
    causal_alignment: str
    window: tuple[int | None, int | None] | None
    softcap: float | None
    dropout_p: float
    sinks: bool = False
    chunk_size: int | None = None
    alibi_slopes: bool = False


def check(
    q: Any,
    k: Any,
    v: Any,
    *,
    mask: Any = None,
    is_causal: Any = False,
    scale: Any = None,
    causal_alignment: Any = "top_left",
    window: Any = None,
    softcap: Any = None,
    dropout_p: Any = 0.0,
    random: tuple[str, Any, bool, str] | None = None,
    unsupported: dict[str, str] | None = None,
    tiles: dict[str, Any] | None = None,
    d_out: Any = None,
    sinks: Any = None,
    chunk_size: Any = None,
    alibi_slopes: Any = None,
    d_lse: Any = None,
    flags: dict[str, Any] | None = None,
) -> Checked:
    """Check one attention call; return its sizes and normalised options.

    Args:
      q, k, v, mask: arrays (``.shape``, ``.dtype``); mask may be None.
      is_causal, scale, causal_alignment, window, softcap, dropout_p: the options as given.
      random: (name, value, acceptable, what is expected) for the impl's source of
        randomness (a NumPy Generator, a JAX key, a torch Generator, a dropout callable),
        checked when it is given or when dropout_p > 0.
      unsupported: {option: why} for options this impl does not implement; a value other
        than the option's default raises NotImplementedError.
      tiles: {name: value} of tile sizes that must be positive ints (blockwise impls).
      d_out: for a backward pass, the upstream gradient, shaped and typed like the output.
      sinks: the sink logits (H,) in q's dtype, or None (SPEC §15).
      chunk_size: the length of a local-attention chunk, an int >= 1, or None (SPEC §16).
      alibi_slopes: ALiBi's slopes (H,) or (B, H) in float32 or q's dtype, or None (§17).
      d_lse: for a backward pass, the log-sum-exp's cotangent, shaped like the lse
        (B, H, T) and in its dtype, the working precision (SPEC §21.4, §21.7), or None.
      flags: {name: value} of the impl's own switches (``return_lse``,
        ``return_weights``), each of which must be a bool: a string such as "yes" is
        refused, not read as Python reads a condition.

    Raises:
      ValueError, TypeError: bad input, with a message naming the argument, the expected
        shape in letters and numbers, and what was given (SPEC §8).
      NotImplementedError: an option in ``unsupported`` was used.
    """
    unbatched = _check_qkv(q, k, v)
    qs, ks, vs = (tuple(x.shape) for x in (q, k, v))
    B, H, T, D = (1, *qs) if unbatched else qs
    K, S, E = ks[-3], ks[-2], vs[-1]
    mask_shape = _check_mask(mask, (B, H, T, S), unbatched)
    is_causal = check_bool("is_causal", is_causal)
    if not isinstance(causal_alignment, str) or causal_alignment not in ALIGNMENTS:
        raise ValueError(
            f"causal_alignment should be one of {ALIGNMENTS}, got {causal_alignment!r}"
        )
    window = check_window(window)
    chunk_size = check_chunk_size(chunk_size)
    softcap = None if softcap is None else check_softcap(softcap, dtype_name(q))
    dropout_p = probability("dropout_p", dropout_p)
    scale = 1.0 / math.sqrt(D) if scale is None else positive("scale", scale)
    if random is not None:
        name, value, acceptable, expected = random
        if not acceptable and value is not None:
            raise TypeError(f"{name} should be {expected}, got {value!r}")
        if not acceptable and dropout_p > 0:
            raise ValueError(f"{name} should be {expected} when dropout_p > 0, got {value!r}")
    for name, flag in (flags or {}).items():
        check_bool(name, flag)
    for name, size in (tiles or {}).items():
        if integer(name, size) <= 0:
            raise ValueError(f"{name} should be a positive int, got {size!r}")
    if d_out is not None:
        check_d_out(d_out, (H, T, E) if unbatched else (B, H, T, E), dtype_name(q))
    if d_lse is not None:
        check_d_lse(d_lse, (H, T) if unbatched else (B, H, T), dtype_name(q))
    if sinks is not None:
        check_sinks(sinks, q)
    if alibi_slopes is not None:
        check_alibi_slopes(alibi_slopes, q)
    checked = Checked(
        unbatched=unbatched,
        B=B,
        H=H,
        K=K,
        G=H // K,
        T=T,
        S=S,
        D=D,
        E=E,
        mask_shape=mask_shape,
        mask_is_bool=mask is not None and dtype_name(mask) == "bool",
        is_causal=is_causal,
        scale=scale,
        causal_alignment=causal_alignment,
        window=window,
        softcap=softcap,
        dropout_p=dropout_p,
        sinks=sinks is not None,
        chunk_size=chunk_size,
        alibi_slopes=alibi_slopes is not None,
    )
    for option, why in (unsupported or {}).items():
        value = getattr(checked, option)
        default = False if option in _ARRAY_OPTIONS else OPTIONS[option].default
        if value != default:
            # sinks and alibi_slopes are arrays; Checked records only that they were given.
            array = option in _ARRAY_OPTIONS
            given, unset = ("an array", "None") if array else (repr(value), repr(default))
            raise NotImplementedError(
                f"{option}={given} is not supported ({why}); leave it at {unset}"
            )
    return checked


@dataclass(frozen=True)
class Option:
    """An option of ``attention``: the value that means "not set", and the capability a
    backend declares to take any other value (None: the core, which every backend takes)."""

    default: Any
    capability: str | None = None


#: Every option of ``attention``, in the signature's order: the one table of the options,
#: their defaults and the capabilities they need. The impls' signatures spell these
#: defaults; the suite (``conformance.vocabulary``, its requirements, the kit) reads them
#: from here.
OPTIONS = {
    "is_causal": Option(False),
    "scale": Option(None),
    "causal_alignment": Option("top_left", "causal_bottom_right"),
    "window": Option(None, "window"),
    "softcap": Option(None, "softcap"),
    "dropout_p": Option(0.0, "dropout"),
    "sinks": Option(None, "sinks"),
    "chunk_size": Option(None, "chunked"),
    "alibi_slopes": Option(None, "alibi"),
}
#: The options ``Checked`` records only as given or not (arrays: sinks, slopes).
_ARRAY_OPTIONS = ("sinks", "alibi_slopes")


def _check_qkv(q: Any, k: Any, v: Any) -> bool:
    """Check ranks, dtypes and sizes of q, k, v; return whether the call is unbatched."""
    qs, ks, vs = (tuple(x.shape) for x in (q, k, v))
    if len(qs) not in (3, 4):
        raise ValueError(
            f"q should have rank 4 (B, H, T, D) or 3 (H, T, D), got rank {len(qs)} with shape {qs}"
        )
    unbatched = len(qs) == 3
    batch = "" if unbatched else "B, "
    for name, shape, letters in (("k", ks, f"({batch}K, S, D)"), ("v", vs, f"({batch}K, S, E)")):
        if len(shape) != len(qs):
            raise ValueError(
                f"{name} should have rank {len(qs)} {letters} like q, got rank {len(shape)} "
                f"with shape {shape}"
            )
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not is_floating(dtype_name(x)):
            raise TypeError(f"{name} should be a floating array, got dtype {dtype_name(x)}")
    for name, x in (("k", k), ("v", v)):
        if dtype_name(x) != dtype_name(q):
            raise TypeError(f"{name} dtype should be {dtype_name(q)} like q, got {dtype_name(x)}")
    lead = () if unbatched else qs[:1]  # (B,) or ()
    H, D = qs[-3], qs[-1]
    K, S, E = ks[-3], ks[-2], vs[-1]
    if K == 0 or H % K != 0:
        raise ValueError(
            f"k heads K={K} should divide q heads H={H} (grouped-query attention shares "
            f"each key/value head among H // K query heads), got k shape {ks}"
        )
    want_k = (*lead, K, S, D)
    if ks != want_k:
        raise ValueError(f"k shape should be ({batch}K, S, D) = {want_k} to match q {qs}, got {ks}")
    want_v = (*lead, K, S, E)
    if vs[:-2] != want_v[:-2]:
        raise ValueError(f"v shape should be ({batch}K, S, E) = {want_v} to match k {ks}, got {vs}")
    if vs[-2] != S:
        # Keys and values come in pairs: either one may be the wrong length.
        raise ValueError(
            f"k and v should have the same length S, got k {ks} with S={S} and v {vs} "
            f"with S={vs[-2]}: v shape should be ({batch}K, S, E) = {want_v} to match k, "
            f"or k shape ({batch}K, S, D) = {(*lead, K, vs[-2], D)} to match v"
        )
    return unbatched


def _check_mask(
    mask: Any, shape: tuple[int, int, int, int], unbatched: bool
) -> tuple[int, int, int, int] | None:
    """Check the mask's dtype and shape; return its shape padded to rank 4, or None."""
    if mask is None:
        return None
    name = dtype_name(mask)
    if name != "bool" and not is_floating(name):
        ambiguous = ": an integer mask is ambiguous" if "int" in name else ""
        raise TypeError(
            f"mask dtype should be bool (True = may attend) or floating (added to the "
            f"scores), got {name}{ambiguous}"
        )
    want = shape[1:] if unbatched else shape
    letters = "(H, T, S)" if unbatched else "(B, H, T, S)"
    got = tuple(mask.shape)
    fits = len(got) <= len(want) and all(m in (1, w) for m, w in zip(reversed(got), reversed(want)))
    if not fits:
        raise ValueError(f"mask shape should broadcast to {letters} = {want}, got {got}")
    return (1,) * (4 - len(got)) + got  # (B|1, H|1, T|1, S|1)


def check_sinks(sinks: Any, q: Any) -> None:
    """Check the sink logits against q: an array of shape (H,), one per query head (also
    for unbatched q), in q's dtype (SPEC §15.1)."""
    H, dtype = tuple(q.shape)[-3], dtype_name(q)
    if not (hasattr(sinks, "shape") and hasattr(sinks, "dtype")):
        raise TypeError(
            f"sinks should be an array of shape (H,) = ({H},) in q's dtype {dtype}, "
            f"got {type(sinks).__name__} {sinks!r}"
        )
    if tuple(sinks.shape) != (H,):
        raise ValueError(
            f"sinks shape should be (H,) = ({H},), one logit per query head, "
            f"got {tuple(sinks.shape)}"
        )
    if dtype_name(sinks) != dtype:
        raise TypeError(f"sinks dtype should be {dtype} like q, got {dtype_name(sinks)}")


def check_alibi_slopes(slopes: Any, q: Any) -> None:
    """Check ALiBi's slopes against q: an array of shape (H,), one slope per query head,
    or, for batched q, (B, H), one per batch element and query head; in float32 (as
    FlashAttention takes them) or q's dtype (SPEC §17.1)."""
    shape, dtype = tuple(q.shape), dtype_name(q)
    H = shape[-3]
    shapes = [(H,)] if len(shape) == 3 else [(H,), (shape[0], H)]
    letters = f"(H,) = {shapes[0]}"
    if len(shapes) == 2:
        letters += f" or (B, H) = {shapes[1]}"
    dtypes = sorted({"float32", dtype})
    if not (hasattr(slopes, "shape") and hasattr(slopes, "dtype")):
        raise TypeError(
            f"alibi_slopes should be an array of shape {letters} in {' or '.join(dtypes)}, "
            f"got {type(slopes).__name__} {slopes!r}"
        )
    if tuple(slopes.shape) not in shapes:
        raise ValueError(
            f"alibi_slopes shape should be {letters}, one slope per query head, "
            f"got {tuple(slopes.shape)}"
        )
    if dtype_name(slopes) not in dtypes:
        raise TypeError(
            f"alibi_slopes dtype should be {' or '.join(dtypes)} (float32 or q's dtype), "
            f"got {dtype_name(slopes)}"
        )


def check_d_out(d_out: Any, want: tuple[int, ...], dtype: str) -> None:
    letters = "(H, T, E)" if len(want) == 3 else "(B, H, T, E)"
    if tuple(d_out.shape) != want:
        raise ValueError(
            f"d_out shape should be the output's {letters} = {want}, got {tuple(d_out.shape)}"
        )
    if dtype_name(d_out) != dtype:
        raise TypeError(f"d_out dtype should be {dtype} like q, got {dtype_name(d_out)}")


def check_d_lse(d_lse: Any, want: tuple[int, ...], dtype: str) -> None:
    letters = "(H, T)" if len(want) == 2 else "(B, H, T)"
    if tuple(d_lse.shape) != want:
        raise ValueError(
            f"d_lse shape should be the lse's {letters} = {want}, got {tuple(d_lse.shape)}"
        )
    # The lse is returned in the working precision (SPEC §21.4): float64 for float64 q,
    # float32 for the others.
    work = "float64" if dtype == "float64" else "float32"
    if dtype_name(d_lse) != work:
        raise TypeError(
            f"d_lse dtype should be {work}, the lse's for {dtype} q, got {dtype_name(d_lse)}"
        )


def check_heads(n_heads: Any, d_model: int) -> int:
    """Check that H = n_heads divides the model width C; return the head dim D = C // H."""
    H = scalar(n_heads)
    if isinstance(H, bool) or not isinstance(H, numbers.Integral) or H <= 0 or d_model % H:
        raise ValueError(
            f"n_heads H={n_heads!r} should be a positive int dividing the model width C={d_model}"
        )
    return d_model // int(H)


def check_module_input(
    x: Any, n_heads: Any, d_model: int | None = None
) -> tuple[int, int, int, int, int]:
    """Check the layer's input x (B, T, C) and its head count; return (B, T, C, H, D)."""
    shape = tuple(x.shape)
    if len(shape) != 3 or (d_model is not None and shape[-1] != d_model):
        width = "" if d_model is None else f" with C = d_model = {d_model}"
        raise ValueError(f"x shape should be (B, T, C){width}, got {shape}")
    B, T, C = shape
    D = check_heads(n_heads, C)
    return B, T, C, C // D, D
