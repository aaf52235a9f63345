"""The input contract every attention impl checks as its step 0, in one place.

Each impl file is a teaching page for the *math*, and imports only the standard library,
NumPy, its own framework and this module; what it accepts is this module's business, so
that the impls cannot drift apart on it (copies of these checks do: one refuses
``softcap=np.float32(2.0)`` that another accepts). The math itself, masks and grouping
included, stays in each impl. This module is plain Python on shapes, dtype names and
option values, and imports no framework: an impl hands it its arrays (anything with
``.shape`` and ``.dtype``: NumPy, JAX, torch) and gets back the sizes and the options in
one normal form, or an error that names the argument, the expected shape in letters and
numbers, and what was given (SPEC §8).

Shape legend (heads-first):

    B batch            H query heads      K key/value heads (H % K == 0)
    G = H // K         T query length     S key/value length
    D q/k head dim     E v head dim

    q (B, H, T, D)    k (B, K, S, D)    v (B, K, S, E)    mask broadcastable to (B, H, T, S)
    unbatched: q (H, T, D), k (K, S, D), v (K, S, E), mask broadcastable to (H, T, S)

One rule for numbers (``scale``, ``softcap``, ``dropout_p``, the window's sides; SPEC §8.4):

- a Python or NumPy scalar, or a 0-d array of an integer or floating dtype, is a number;
  all of them are read as the same Python ``float`` (or ``int``);
- ``bool`` is not a number (``softcap=True`` is a mistake, not 1.0), nor is a NumPy bool,
  a string, ``None`` where a number is required, a complex number, or an array with
  elements: each raises ``TypeError``;
- a number outside the option's range raises ``ValueError``: ``scale`` and ``softcap``
  must be finite and > 0 (so -0.0, inf and NaN are refused; 1e300 and 5e-324 are
  accepted as a scale), ``dropout_p`` must lie in [0, 1) (-0.0 is 0), a window side must
  be an integer >= 0;
- ``softcap`` must also be at least the smallest normal number of the working precision
  (float64 for float64 inputs, float32 for the others): a subnormal softcap may be
  flushed to zero (XLA on a CPU flushes float32 subnormals), and a score of 0 divided by
  it is then 0 / 0 = NaN. (A tiny ``scale`` flushed to zero is harmless: every score
  becomes 0.)

``is_causal`` is a Python or NumPy bool (or a 0-d bool array); ``causal_alignment`` one of
``ALIGNMENTS``; ``sinks`` (SPEC §15) an array of shape (H,), one logit per query head, in
q's dtype; ``chunk_size`` (SPEC §16) None or an int >= 1 (the window's rule for ints:
``bool`` and floats are refused); ``alibi_slopes`` (SPEC §17) an array of shape (H,) or,
for batched q, (B, H), in float32 or q's dtype. An option the impl does not implement is refused with
``NotImplementedError`` naming it, once its value has passed the checks above.

Packed variable-length sequences (SPEC §18, ``check_packed``): q (H, T, D), k (K, S, D),
v (K, S, E) hold N documents one after another; ``cu_seqlens_q`` and ``cu_seqlens_k`` are
1-D integer arrays (N + 1,) of cumulative lengths, starting at 0, nondecreasing, ending at
T and S, with the same N.

Paged KV caches (SPEC §19, ``check_paged``): q (B, H, T, D), k_pages (N, K, L, D), v_pages
(N, K, L, E), N pages of L slots; block_table (B, M) and seq_lens (B,) of an integer
dtype; 0 <= seq_lens[b] <= M·L, every table entry a sequence reads (j < ⌈seq_lens[b] /
L⌉) in [0, N), and, with is_causal, T <= seq_lens[b]. Entries past a sequence's length
are not looked at: they may hold anything (-1 is common).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any

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
    is_causal = _check_bool("is_causal", is_causal)
    if not isinstance(causal_alignment, str) or causal_alignment not in ALIGNMENTS:
        raise ValueError(
            f"causal_alignment should be one of {ALIGNMENTS}, got {causal_alignment!r}"
        )
    window = check_window(window)
    chunk_size = check_chunk_size(chunk_size)
    softcap = None if softcap is None else _softcap(softcap, _dtype_name(q))
    dropout_p = _probability("dropout_p", dropout_p)
    scale = 1.0 / math.sqrt(D) if scale is None else _positive("scale", scale)
    if random is not None:
        name, value, acceptable, expected = random
        if not acceptable and value is not None:
            raise TypeError(f"{name} should be {expected}, got {value!r}")
        if not acceptable and dropout_p > 0:
            raise ValueError(f"{name} should be {expected} when dropout_p > 0, got {value!r}")
    for name, size in (tiles or {}).items():
        if _integer(name, size) <= 0:
            raise ValueError(f"{name} should be a positive int, got {size!r}")
    if d_out is not None:
        _check_d_out(d_out, (H, T, E) if unbatched else (B, H, T, E), _dtype_name(q))
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
        mask_is_bool=mask is not None and _dtype_name(mask) == "bool",
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
        value, default = getattr(checked, option), _DEFAULTS[option]
        if value != default:
            # sinks and alibi_slopes are arrays; Checked records only that they were given.
            array = option in ("sinks", "alibi_slopes")
            given, unset = ("an array", "None") if array else (repr(value), repr(default))
            raise NotImplementedError(
                f"{option}={given} is not supported ({why}); leave it at {unset}"
            )
    return checked


#: The value of each option that means "not used", for ``unsupported``.
_DEFAULTS = {
    "is_causal": False,
    "causal_alignment": "top_left",
    "window": None,
    "softcap": None,
    "dropout_p": 0.0,
    "sinks": False,
    "chunk_size": None,
    "alibi_slopes": False,
}


def _dtype_name(x: Any) -> str:
    # NumPy and JAX dtypes have a name ("float32", "bfloat16"); torch's print as
    # "torch.float32".
    dtype = x.dtype
    return getattr(dtype, "name", None) or str(dtype).removeprefix("torch.")


def _is_floating(name: str) -> bool:
    return name.startswith("float") or name == "bfloat16"


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
        if not _is_floating(_dtype_name(x)):
            raise TypeError(f"{name} should be a floating array, got dtype {_dtype_name(x)}")
    for name, x in (("k", k), ("v", v)):
        if _dtype_name(x) != _dtype_name(q):
            raise TypeError(f"{name} dtype should be {_dtype_name(q)} like q, got {_dtype_name(x)}")
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
    name = _dtype_name(mask)
    if name != "bool" and not _is_floating(name):
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
    H, dtype = tuple(q.shape)[-3], _dtype_name(q)
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
    if _dtype_name(sinks) != dtype:
        raise TypeError(f"sinks dtype should be {dtype} like q, got {_dtype_name(sinks)}")


def check_alibi_slopes(slopes: Any, q: Any) -> None:
    """Check ALiBi's slopes against q: an array of shape (H,), one slope per query head,
    or, for batched q, (B, H), one per batch element and query head; in float32 (as
    FlashAttention takes them) or q's dtype (SPEC §17.1)."""
    shape, dtype = tuple(q.shape), _dtype_name(q)
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
    if _dtype_name(slopes) not in dtypes:
        raise TypeError(
            f"alibi_slopes dtype should be {' or '.join(dtypes)} (float32 or q's dtype), "
            f"got {_dtype_name(slopes)}"
        )


def check_chunk_size(chunk_size: Any) -> int | None:
    """None, or the chunk length of chunked local attention as an int >= 1 (SPEC §16): a
    Python or NumPy int (or 0-d integer array); bool and floats are not chunk lengths."""
    if chunk_size is None:
        return None
    x = _scalar(chunk_size)
    if isinstance(x, bool) or not isinstance(x, numbers.Integral):
        raise TypeError(f"chunk_size should be an int >= 1 or None, got {chunk_size!r}")
    if x < 1:
        raise ValueError(f"chunk_size should be an int >= 1 or None, got {chunk_size!r}")
    return int(x)


def check_packed(
    q: Any,
    k: Any,
    v: Any,
    cu_seqlens_q: Any,
    cu_seqlens_k: Any,
    **options: Any,
) -> tuple[Checked, list[int], list[int]]:
    """Check one packed call (SPEC §18): q (H, T, D), k (K, S, D), v (K, S, E) in the
    unbatched layout, the documents' cumulative lengths, and the options of ``check``
    (no mask, no dropout: the documents are the mask). Returns the checked call and the
    two boundary lists as Python ints, [0, ..., T] and [0, ..., S], both N + 1 long."""
    for name, x, letters in (("q", q, "(H, T, D)"), ("k", k, "(K, S, D)"), ("v", v, "(K, S, E)")):
        shape = tuple(x.shape)
        if len(shape) != 3:
            raise ValueError(
                f"{name} should have rank 3 {letters} (packed: every document's tokens one "
                f"after another), got rank {len(shape)} with shape {shape}"
            )
    call = check(q, k, v, **options)
    cu_q, cu_k = check_boundaries(cu_seqlens_q, cu_seqlens_k, call.T, call.S)
    return call, cu_q, cu_k


def check_boundaries(
    cu_seqlens_q: Any, cu_seqlens_k: Any, T: int, S: int
) -> tuple[list[int], list[int]]:
    """Both boundary arrays of a packed call (SPEC §18.1), as Python ints: each checked by
    ``check_cu_seqlens``, and the same number of documents N in both."""
    cu_q = check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, T, "T")
    cu_k = check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, S, "S")
    if len(cu_q) != len(cu_k):
        raise ValueError(
            f"cu_seqlens_k should have the same number of documents N as cu_seqlens_q, "
            f"shape (N + 1,) = ({len(cu_q)},), got shape ({len(cu_k)},)"
        )
    return cu_q, cu_k


def check_cu_seqlens(name: str, cu_seqlens: Any, total: int, letter: str) -> list[int]:
    """The boundaries of packed documents as Python ints: a 1-D integer array (N + 1,),
    starting at 0, nondecreasing, ending at ``total`` (T for queries, S for keys)."""
    expected = f"a 1-D integer array (N + 1,) from 0 to {letter} = {total}, nondecreasing"
    if not (hasattr(cu_seqlens, "shape") and hasattr(cu_seqlens, "dtype")):
        raise TypeError(
            f"{name} should be {expected}, got {type(cu_seqlens).__name__} {cu_seqlens!r}"
        )
    dtype = _dtype_name(cu_seqlens)
    if "int" not in dtype:  # int8 ... int64 and uint*; bool and floats are not lengths
        raise TypeError(f"{name} dtype should be an integer dtype, got {dtype}")
    shape = tuple(cu_seqlens.shape)
    if len(shape) != 1 or shape[0] < 1:
        raise ValueError(f"{name} shape should be (N + 1,) with N >= 0, got {shape}")
    bounds = [int(x) for x in cu_seqlens.tolist()]
    if bounds[0] != 0:
        raise ValueError(f"{name} should start at 0, got {bounds[0]} in {bounds}")
    for n in range(len(bounds) - 1):
        if bounds[n + 1] < bounds[n]:
            raise ValueError(
                f"{name} should be nondecreasing (document lengths >= 0), got "
                f"{bounds[n + 1]} after {bounds[n]} at index {n + 1} in {bounds}"
            )
    if bounds[-1] != total:
        raise ValueError(f"{name} should end at {letter} = {total}, got {bounds[-1]} in {bounds}")
    return bounds


def _check_d_out(d_out: Any, want: tuple[int, ...], dtype: str) -> None:
    letters = "(H, T, E)" if len(want) == 3 else "(B, H, T, E)"
    if tuple(d_out.shape) != want:
        raise ValueError(
            f"d_out shape should be the output's {letters} = {want}, got {tuple(d_out.shape)}"
        )
    if _dtype_name(d_out) != dtype:
        raise TypeError(f"d_out dtype should be {dtype} like q, got {_dtype_name(d_out)}")


# --- Paged KV caches (SPEC §19) -------------------------------------------------------------


@dataclass(frozen=True)
class PagedChecked:
    """What ``check_paged`` found: the sizes, each sequence's length and the pages it reads
    (``pages[b]``: its table's first ⌈seq_lens[b] / L⌉ entries), and the options."""

    B: int
    H: int
    K: int
    G: int
    T: int
    D: int
    E: int
    N: int
    L: int
    M: int
    seq_lens: tuple[int, ...]
    pages: tuple[tuple[int, ...], ...]
    is_causal: bool
    scale: float
    window: tuple[int | None, int | None] | None
    softcap: float | None


def check_paged(
    q: Any,
    k_pages: Any,
    v_pages: Any,
    block_table: Any,
    seq_lens: Any,
    *,
    is_causal: Any = False,
    scale: Any = None,
    window: Any = None,
    softcap: Any = None,
    d_out: Any = None,
) -> PagedChecked:
    """Check one paged call (SPEC §19); return its sizes, lengths and pages.

    The table and the lengths are read as values (``.tolist()``, which NumPy, torch and
    concrete JAX arrays all have), so an impl calls this before it traces or compiles.

    Raises:
      ValueError, TypeError: bad input, naming the argument, what was expected and what
        was given (SPEC §8, §19.5).
    """
    qs, ks, vs = (tuple(x.shape) for x in (q, k_pages, v_pages))
    if len(qs) != 4:
        raise ValueError(f"q should have rank 4 (B, H, T, D), got rank {len(qs)} with shape {qs}")
    for name, shape, letters in (("k_pages", ks, "(N, K, L, D)"), ("v_pages", vs, "(N, K, L, E)")):
        if len(shape) != 4:
            raise ValueError(
                f"{name} should have rank 4 {letters}, got rank {len(shape)} with shape {shape}"
            )
    for name, x in (("q", q), ("k_pages", k_pages), ("v_pages", v_pages)):
        if not _is_floating(_dtype_name(x)):
            raise TypeError(f"{name} should be a floating array, got dtype {_dtype_name(x)}")
    for name, x in (("k_pages", k_pages), ("v_pages", v_pages)):
        if _dtype_name(x) != _dtype_name(q):
            raise TypeError(f"{name} dtype should be {_dtype_name(q)} like q, got {_dtype_name(x)}")
    B, H, T, D = qs
    N, K, L, _ = ks
    E = vs[-1]
    if K == 0 or H % K != 0:
        raise ValueError(
            f"k_pages heads K={K} should divide q heads H={H} (grouped-query attention), "
            f"got k_pages shape {ks}"
        )
    if ks != (N, K, L, D):
        raise ValueError(
            f"k_pages shape should be (N, K, L, D) = {(N, K, L, D)} to match q {qs}, got {ks}"
        )
    if vs[:3] != (N, K, L):
        raise ValueError(
            f"v_pages shape should be (N, K, L, E) = {(N, K, L, E)} to match k_pages {ks}, got {vs}"
        )
    if L < 1:
        raise ValueError(f"k_pages should have L >= 1 slots per page, got shape {ks}")
    table = _check_index_array("block_table", block_table, "(B, M)", 2, B)
    lens = _check_index_array("seq_lens", seq_lens, "(B,)", 1, B)
    M = tuple(block_table.shape)[1]
    pages = []
    for b, n in enumerate(lens):
        if not 0 <= n <= M * L:
            raise ValueError(
                f"seq_lens[{b}] should lie in [0, M·L] = [0, {M * L}] (M = {M} table entries "
                f"of L = {L} slots), got {n}"
            )
        used = table[b][: -(-n // L)]  # the ⌈n / L⌉ pages sequence b reads
        for j, page in enumerate(used):
            if not 0 <= page < N:
                raise ValueError(
                    f"block_table[{b}, {j}] should be a page in [0, N) = [0, {N}) since "
                    f"sequence {b} reads it (seq_lens[{b}] = {n}), got {page}"
                )
        pages.append(tuple(used))
    is_causal = _check_bool("is_causal", is_causal)
    if is_causal:
        for b, n in enumerate(lens):
            if n < T:
                raise ValueError(
                    f"seq_lens[{b}] should be at least T = {T} with is_causal (the queries "
                    f"are the last T positions of each sequence), got {n}"
                )
    window = check_window(window)
    softcap = None if softcap is None else _softcap(softcap, _dtype_name(q))
    scale = 1.0 / math.sqrt(D) if scale is None else _positive("scale", scale)
    if d_out is not None:
        _check_d_out(d_out, (B, H, T, E), _dtype_name(q))
    return PagedChecked(
        B=B,
        H=H,
        K=K,
        G=H // K,
        T=T,
        D=D,
        E=E,
        N=N,
        L=L,
        M=M,
        seq_lens=tuple(lens),
        pages=tuple(pages),
        is_causal=is_causal,
        scale=scale,
        window=window,
        softcap=softcap,
    )


def _check_index_array(name: str, x: Any, letters: str, rank: int, B: int) -> list:
    """An integer array of shape ``letters`` with B rows, as nested Python ints."""
    if not (hasattr(x, "shape") and hasattr(x, "dtype")):
        raise TypeError(f"{name} should be an integer array {letters}, got {type(x).__name__}")
    dtype = _dtype_name(x)
    if "int" not in dtype:  # int8-64, uint8-64; bool and floats are not indices
        raise TypeError(f"{name} dtype should be an integer dtype, got {dtype}")
    shape = tuple(x.shape)
    if len(shape) != rank or shape[0] != B:
        want = "(B, M)" if rank == 2 else f"(B,) = ({B},)"
        raise ValueError(f"{name} shape should be {want} with B = {B} like q, got {shape}")
    return (
        [int(n) for n in x.tolist()] if rank == 1 else [[int(n) for n in row] for row in x.tolist()]
    )


# --- The one rule for numbers ----------------------------------------------------------------


def _scalar(value: Any) -> Any:
    """A NumPy scalar or a 0-d array (NumPy, JAX, torch) as the Python scalar it holds;
    anything else as it is."""
    if getattr(value, "ndim", None) == 0 and hasattr(value, "item"):
        return value.item()
    return value


def _number(name: str, value: Any, expected: str) -> float:
    """The float a Python or NumPy number (or 0-d array) stands for; TypeError otherwise."""
    x = _scalar(value)
    # numbers.Real is int and float here (NumPy scalars were made Python ones above);
    # bool is an int subclass, but not a number.
    if isinstance(x, bool) or not isinstance(x, numbers.Real):
        raise TypeError(f"{name} should be {expected}, got {value!r}")
    return float(x)


def _positive(name: str, value: Any) -> float:
    x = _number(name, value, "a positive finite float or None")
    if not (math.isfinite(x) and x > 0):
        raise ValueError(f"{name} should be a positive finite float, got {value!r}")
    return x


# The smallest normal number of each working precision (float16 and bfloat16 inputs are
# computed in float32).
_SMALLEST_NORMAL = {"float64": 2.0**-1022, "float32": 2.0**-126}


def _softcap(value: Any, dtype: str) -> float:
    x = _positive("softcap", value)
    work = "float64" if dtype == "float64" else "float32"
    if x < _SMALLEST_NORMAL[work]:
        raise ValueError(
            f"softcap should be at least {_SMALLEST_NORMAL[work]!r}, the smallest normal "
            f"{work} ({dtype} inputs are computed in {work}; a subnormal softcap may be "
            f"flushed to 0, and 0 / 0 is NaN), got {value!r}"
        )
    return x


def _probability(name: str, value: Any) -> float:
    x = _number(name, value, "a float in [0, 1)")
    if not 0.0 <= x < 1.0:
        raise ValueError(f"{name} should be a float in [0, 1), got {value!r}")
    return x + 0.0  # -0.0 becomes 0.0


def _integer(name: str, value: Any) -> int:
    x = _scalar(value)
    if isinstance(x, bool) or not isinstance(x, numbers.Integral):
        raise TypeError(f"{name} should be an int, got {value!r}")
    return int(x)


def _check_bool(name: str, value: Any) -> bool:
    x = _scalar(value)  # a NumPy bool becomes a Python bool here
    if isinstance(x, bool):
        return x
    raise TypeError(f"{name} should be a bool, got {value!r}")


def check_window(window: Any) -> tuple[int | None, int | None] | None:
    """A pair (left, right) of ints >= 0 or None, as a tuple (hashable, for jax.jit)."""
    if window is None:
        return None
    pair = f"window should be a pair (left, right) of ints >= 0 or None, got {window!r}"
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        raise ValueError(pair)
    sides = []
    for side in window:
        if side is None:
            sides.append(None)
            continue
        x = _scalar(side)
        if isinstance(x, bool) or not isinstance(x, numbers.Integral):
            raise TypeError(f"{pair}: {side!r} is not an int")
        if x < 0:
            raise ValueError(pair)
        sides.append(int(x))
    return (sides[0], sides[1])


# --- The multi-head layer --------------------------------------------------------------------


def check_heads(n_heads: Any, d_model: int) -> int:
    """Check that H = n_heads divides the model width C; return the head dim D = C // H."""
    H = _scalar(n_heads)
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
