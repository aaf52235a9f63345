"""What the conformance tests share: random inputs, tolerances, the oracle kept for the run.

What a test needs (capabilities, dtypes) is declared with ``conformance.suite.requirements``.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from conformance.adapters.forms import forms_of, forms_used
from conformance.backends import numpy_dtype
from conformance.suite import sizes
from conformance.suite.cases import case_marks
from conformance.suite.requirements import requires
from conformance.suite.tolerance import expect, finite_error, tolerance


def random_qkv(
    seed: int,
    *,
    B: int = 2,
    H: int = 3,
    K: int | None = None,
    T: int = 7,
    S: int = 13,
    D: int = 5,
    E: int | None = None,
    dtype: str = "float64",
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Standard-normal q (B, H, T, D), k (B, K, S, D), v (B, K, S, E) in ``dtype``."""
    rng = np.random.default_rng(seed)
    K = K or H
    E = E or D
    dt = numpy_dtype(dtype)
    q = rng.standard_normal((B, H, T, D)).astype(dt)
    k = rng.standard_normal((B, K, S, D)).astype(dt)
    v = rng.standard_normal((B, K, S, E)).astype(dt)
    return q, k, v


def pool_qkv(seed: int, name: str, backend, dtype: str = "float64") -> tuple[np.ndarray, ...]:
    """``random_qkv`` at the size pool's shape ``name`` (SPEC §13.21), as ``backend`` can
    take it (``sizes.pooled_shape``)."""
    caps = backend.capabilities
    shape = sizes.pooled_shape(
        sizes.SHAPES[name][0], gqa="gqa" in caps, value_dim="value_dim" in caps, unbatched=False
    )
    return random_qkv(seed, **shape._asdict(), dtype=dtype)


def worked_qkv(example: dict, backend, dtype: str, lead: int) -> tuple[np.ndarray, ...]:
    """q, k, v of a hand-checked example (fixtures/worked_example.json) in ``dtype``, with
    ``lead`` leading axes of 1. The variants' examples have q and k of head size D = 1 and
    v of E = 2; a backend that does not declare "value_dim" gets q and k with a column of
    zeros after theirs (D = E = 2): every score q·k is the same, so the hand values hold."""
    q, k, v = (np.array(example[n], dtype=numpy_dtype(dtype)) for n in "qkv")
    E = v.shape[-1]
    if q.shape[-1] != E and "value_dim" not in backend.capabilities:
        q, k = (np.pad(x, [(0, 0), (0, E - x.shape[-1])]) for x in (q, k))
    return tuple(x.reshape((1,) * lead + x.shape) for x in (q, k, v))


def random_tolerance(q, k, v, dtype: str, **options) -> float:
    """SPEC §7's tolerance for inputs without a fixture: the naive run in ``dtype`` against
    the same naive run in float64, which for these sizes is far closer to the oracle than
    any low-precision result."""
    from conformance.fixtures.oracle import naive_same_precision

    ref = naive_same_precision(q, k, v, np.float64, **options)
    low = naive_same_precision(q, k, v, numpy_dtype(dtype), **options)
    return tolerance(dtype, float(np.max(np.abs(low - ref), initial=0.0)), ref)


def as64(x) -> np.ndarray:
    return np.asarray(x).astype(np.float64)


#: The dtypes every backend declares, as an axis of ``pairwise_params``.
DTYPE_AXIS = {"float64": "float64", "float32": "float32"}

#: Sizes every invariant runs on: awkward ones find bugs that round ones hide (SPEC §13.21's
#: pool, ``conformance.suite.sizes``).
SIZES = sizes.SIZES


def all_pairs(axes: dict[str, dict[str, object]]) -> list[tuple[dict[str, str], tuple]]:
    """Rows over the parameter ``axes`` (each a name mapped to ``{id: value}``) in which
    every value of each axis meets every value of every other axis at least once: a
    covering array of strength 2, built greedily (each row the first of the full product
    that meets the most pairs not yet met), so the same axes always give the same rows.

    For a test whose axes are independent things to try a clause against (a setup, a size,
    a dtype, a chunk length), the full product repeats work: each pair of values is tried
    many times over. These rows keep every pair, in about as many rows as the two largest
    axes' product, where each row is a distinct program for a compiling backend. Returns
    (ids, values) per row, in the order of the full product.

    >>> rows = all_pairs({"a": {"x": 1, "y": 2}, "b": {"p": 0, "q": 1}, "c": {"u": 0, "v": 1}})
    >>> len(rows), rows[0]
    (4, ({'a': 'x', 'b': 'p', 'c': 'u'}, (1, 0, 0)))
    """
    names = list(axes)
    ids = [list(axes[n]) for n in names]
    pairs = list(itertools.combinations(range(len(names)), 2))
    candidates = list(itertools.product(*(range(len(i)) for i in ids)))
    unmet = {(i, row[i], j, row[j]) for row in candidates for i, j in pairs}
    chosen = []
    while unmet:
        row = max(candidates, key=lambda r: sum((i, r[i], j, r[j]) in unmet for i, j in pairs))
        unmet -= {(i, row[i], j, row[j]) for i, j in pairs}
        chosen.append(row)
    return [
        (
            {n: ids[a][row[a]] for a, n in enumerate(names)},
            tuple(axes[n][ids[a][row[a]]] for a, n in enumerate(names)),
        )
        for row in sorted(chosen)
    ]


def setup_params(
    setups: dict[str, tuple[dict, tuple[str, ...]]], grad: bool = False, uses: dict | None = None
) -> list:
    """pytest parameters, one per named setup ``{name: (options, capabilities)}``, each
    marked with the capabilities it needs and the forms of the core its options use
    (``causal_top_left`` is dropped where the test's size is square); with ``grad``, also
    those of its backward: "grad", "grad_softcap" with a softcap, "grad_mask" with a float
    mask (SPEC §12.2-§12.3). ``uses``: options every setup is called with besides its own
    (a chunk_size), for the forms they need."""
    params = []
    for name, (options, caps) in setups.items():
        needs = [*caps, *forms_used({**options, **(uses or {})})]
        if grad:
            needs.append("grad")
            if "softcap" in options:
                needs.append("grad_softcap")
            if options.get("mask") == "float":
                needs.append("grad_mask")
        params.append(pytest.param(name, marks=requires(*needs), id=name))
    return params


def pairwise_params(setups: list, **axes: dict[str, object]) -> list:
    """pytest parameters (setup, *axes) for ``parametrize``, the rows of ``all_pairs``:
    ``setups`` are ``pytest.param`` sets of one value each, whose id and marks (the
    capabilities a setup needs) every row that uses them keeps; each axis is ``{id:
    value}``. The row's id is its ids joined by "-"."""
    by_id = {p.id: p for p in setups}
    rows = all_pairs({"setup": {i: i for i in by_id}, **axes})
    return [
        pytest.param(
            *by_id[ids["setup"]].values,
            *values[1:],
            marks=by_id[ids["setup"]].marks,
            id="-".join(ids.values()),
        )
        for ids, values in rows
    ]


def causal_where_taken(backend, T: int, S: int) -> dict:
    """``{"is_causal": True}`` where ``backend`` takes top-left causality at these sizes, else
    ``{}``: for a test whose clause is not about causality, which runs causal where it can
    and unmasked on a function that takes no causality (SPEC §13.17)."""
    forms = forms_of(backend)
    if "causal" in forms and (T == S or "causal_top_left" in forms):
        return {"is_causal": True}
    return {}


def fixture_marks(entry: dict, *clauses: str) -> list:
    """A fixture case's marks (``cases.case_marks``) and the forms of the core its options
    use at its sizes (SPEC §13.17)."""
    shape = entry["shape"]
    options = {**entry.get("options", {}), "mask": entry.get("mask")}
    forms = forms_used(options, shape.get("T"), shape.get("S"))
    return case_marks(entry, *clauses) + ([requires(*forms)] if forms else [])


def causal_param(value: bool = True, id: str = "causal"):
    """A ``causal`` parameter (top-left ``is_causal``), marked with the forms it needs."""
    return pytest.param(value, marks=requires("causal", "causal_top_left"), id=id)


def oracle_attention(q, k, v, *, mask=None, **options) -> np.ndarray:
    """The mpmath oracle on float64 inputs, asked once per distinct input: its rows cost
    milliseconds each, and every backend (and every mutant of the project's tests) asks for
    the same inputs, run after run (``conformance.suite.oracle_store``)."""
    from conformance.suite.oracle_store import oracle

    return oracle.attention(q, k, v, mask=mask, **options)


def oracle_and_tolerance(q, k, v, dtype: str, **options) -> tuple[np.ndarray, float]:
    """The oracle's output on the inputs as given, and SPEC §7's tolerance: the naive run
    in ``dtype`` against the oracle (the variants' tests: sinks, chunks, ALiBi)."""
    from conformance.fixtures.oracle import naive_same_precision

    wide = {
        n: as64(x) if isinstance(x, np.ndarray) and x.dtype != bool else x
        for n, x in options.items()
    }
    expected = oracle_attention(as64(q), as64(k), as64(v), **wide)
    naive = naive_same_precision(as64(q), as64(k), as64(v), numpy_dtype(dtype), **wide)
    return expected, tolerance(dtype, finite_error(naive, expected), expected)


def expect_no_weight_on_future_keys(name: str, w: np.ndarray, T: int, S: int) -> None:
    """Top-left causal weights (..., T, S): every key after its query's position has
    weight exactly 0."""
    future = np.triu(np.ones((T, S), dtype=bool), k=1)  # (T, S)
    expect(
        (w[..., future] == 0).all(),
        "puts weight on a key that a causal mask blocks",
        f"{name}: weight on a future key: {np.abs(w[..., future]).max()}",
    )
