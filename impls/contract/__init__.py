"""The input contract every attention impl checks as its step 0, in one place.

Each impl file is a teaching page for the *math*, and imports only the standard library,
NumPy, its own framework and this package; what it accepts is this package's business, so
that the impls cannot drift apart on it (copies of these checks do: one refuses
``softcap=np.float32(2.0)`` that another accepts). The math itself, masks and grouping
included, stays in each impl. This package is plain Python on shapes, dtype names and
option values, and imports no framework: an impl hands it its arrays (anything with
``.shape`` and ``.dtype``: NumPy, JAX, torch) and gets back the sizes and the options in
one normal form, or an error that names the argument, the expected shape in letters and
numbers, and what was given (SPEC §8). Its pages: ``core.py`` checks one call,
``layouts.py`` the packed and paged layouts, ``numbers.py`` holds the rule for numbers.

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

from .core import (
    ALIGNMENTS,
    OPTIONS,
    Checked,
    Option,
    check,
    check_alibi_slopes,
    check_d_out,
    check_heads,
    check_module_input,
    check_sinks,
)
from .layouts import PagedChecked, check_boundaries, check_cu_seqlens, check_packed, check_paged
from .merge import check_merge
from .numbers import check_bool, check_chunk_size, check_window

__all__ = [
    "ALIGNMENTS",
    "OPTIONS",
    "Checked",
    "Option",
    "PagedChecked",
    "check",
    "check_alibi_slopes",
    "check_bool",
    "check_boundaries",
    "check_chunk_size",
    "check_cu_seqlens",
    "check_d_out",
    "check_heads",
    "check_merge",
    "check_module_input",
    "check_packed",
    "check_paged",
    "check_sinks",
    "check_window",
]
