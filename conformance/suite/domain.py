"""Calls carried into a kernel's declared domain, or stopped, by name, before they reach it.

Every call a test makes passes through here (``replay.RecordingBackend``) before the
backend sees it. A function judged on what it declares is handed nothing else:

- **forms no test declares** (``forms.CALL_FORMS``): a call without ``is_causal=True`` to a
  causal-only kernel, a bool or float mask to a kernel that takes none of that kind. The
  test is skipped, naming the form, as an undeclared capability is at collection.
- **shapes** (``conformance.adapters.domain``): a call outside the kernel's head dims and
  lengths is carried into the domain where the same call exists there exactly, and
  otherwise skipped, naming why.

Carrying a call changes no number the test checks. The carried call is the test's own call
with its inputs at the kernel's shapes:

- q and k get zero columns up to the domain's head dim D' (every score q·k is the same sum
  with zero terms added), v zero columns up to E', sliced off the output; the scale stays
  1/sqrt(D) of the test's D, passed as the ``scale`` keyword (a kernel without one cannot be
  carried to another D);
- T grows by query rows, S by keys: appended (top-left alignment, or none) or prepended
  (bottom-right), so every real query keeps its position and the keys it sees; the added
  queries' output rows are sliced off, and the added keys are blocked by the call's mask
  (padded) or a mask built for them, or, for a kernel that takes no mask, lie after every
  real query under top-left causality;
- the backward's ``d_out`` gets zeros in the added rows and columns, so they add exactly 0
  to every gradient, and the gradients are sliced back.

The expected values stay the oracle's for the test's inputs, which are mathematically those
of the carried call. Where no exact carry exists (an empty sequence, dropout, ALiBi, a
float mask's gradient, malformed inputs, a kernel with no mask and no causality to hide
the added keys), the test is skipped, naming it; the run's summary lists every clause whose
tests were all skipped so as untested (``domain_summary.DomainSummary``).
"""

from __future__ import annotations

import collections
import math
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from conformance.adapters.domain import Domain
from conformance.adapters.forms import CALL_FORMS, FORMS, forms_of, forms_used, visibility
from conformance.vocabulary import option_is_set

#: The calls a domain applies to; a backend with a domain takes no other kind of call here.
CARRIED = ("attention", "attention_vjp")
#: The entry points whose calls use the forms of ``CALL_FORMS``.
FORM_CALLS = (*CARRIED, "attention_packed", "attention_packed_vjp")
#: How a skip for an undeclared form or shape begins: "<name> lacks form", "outside the
#: domain of <name>"; the summary counts the clauses they leave untested.
OUTSIDE = "outside the domain of"
LACKS_FORM = "lacks form"


#: The maps back to the test's shapes of the latest carried calls, by the clock of their
#: log entry (``replay``): the diagnosis holds a departing output against the misreadings
#: of the call the kernel received, mapped back as its output was.
CARRIED_BACK: collections.OrderedDict[int, Callable[[Any], Any]] = collections.OrderedDict()
_CARRIED_KEPT = 64


def remember_carried(clock: int, back: Callable[[Any], Any]) -> None:
    """Keep ``back`` for the logged call ``clock``, where the call was carried."""
    if back is _same:
        return
    CARRIED_BACK[clock] = back
    while len(CARRIED_BACK) > _CARRIED_KEPT:
        CARRIED_BACK.popitem(last=False)


def domain_of(backend: Any) -> Domain:
    """The shapes ``backend`` accepts: its ``domain``, or every shape."""
    return getattr(backend, "domain", None) or Domain()


def restricted(backend: Any) -> bool:
    """Whether ``backend`` declares a domain or leaves out a form that no test declares."""
    return not domain_of(backend).everything or not set(CALL_FORMS) <= forms_of(backend)


def carry(
    backend: Any, method: str, args: tuple, kwargs: dict
) -> tuple[tuple, dict, Callable[[Any], Any]]:
    """(args, kwargs) as ``backend.method`` receives them, and the map of its result back
    to the test's shapes.

    Raises:
      pytest.skip.Exception: the call uses a form ``backend`` does not take, or lies
        outside its domain with no exact carry into it (the reason names which).
    """
    if method in FORM_CALLS:
        _check_call_forms(backend, kwargs)
    domain = domain_of(backend)
    if domain.everything:
        return args, kwargs, _same
    if method not in CARRIED:
        pytest.skip(f"{OUTSIDE} {backend.name}: only attention and attention_vjp are carried")
    dtype = getattr(getattr(args[0], "dtype", None), "name", "") if args else ""
    return _carry(backend, domain.of(method).for_dtype(dtype), method, args, kwargs)


def _same(result: Any) -> Any:
    return result


def _check_call_forms(backend: Any, kwargs: dict) -> None:
    takes = forms_of(backend)
    try:
        used = forms_used(kwargs)
    except (TypeError, ValueError):  # a malformed option, for the backend to refuse
        return
    for form in CALL_FORMS:
        if form in used and form not in takes:
            pytest.skip(f"{backend.name} {LACKS_FORM} {form!r}: {FORMS[form]}")


def _well_formed(args: tuple, vjp: bool) -> bool:
    arrays = args[: 4 if vjp else 3]
    if len(arrays) < (4 if vjp else 3) or not all(isinstance(x, np.ndarray) for x in arrays):
        return False
    q, k, v = arrays[:3]
    if not (q.ndim == k.ndim == v.ndim and q.ndim in (3, 4)):
        return False
    if q.shape[-1] != k.shape[-1] or k.shape[-2] != v.shape[-2] or k.shape[:-2] != v.shape[:-2]:
        return False
    return not vjp or arrays[3].shape == (*q.shape[:-1], v.shape[-1])


def _carry(backend, domain: Domain, method: str, args: tuple, kwargs: dict):
    vjp = method.endswith("_vjp")
    name = backend.name
    where = f"{OUTSIDE} {name} ({domain.words()})"
    if not _well_formed(args, vjp):
        pytest.skip(f"{where}: malformed inputs (a refusal test) are not carried into it")
    q, k, v = args[:3]
    T, D = q.shape[-2:]
    S, E = k.shape[-2], v.shape[-1]
    why = domain.why_not(T, S, D, E)
    if why is None:
        return args, kwargs, _same
    stop = f"{where}: {why}"
    if T == 0 or S == 0:
        pytest.skip(f"{stop}; an empty sequence has no counterpart inside it")
    for option, words in (("dropout_p", "dropout"), ("alibi_slopes", "ALiBi's positions")):
        if option in kwargs and option_is_set(option, kwargs[option]):
            pytest.skip(f"{stop}; a call with {words} is not carried into it")
    mask = kwargs.get("mask")
    if (
        vjp
        and mask is not None
        and np.asarray(mask).dtype != np.bool_
        and "grad_mask" in backend.capabilities
    ):
        pytest.skip(f"{stop}; a float mask's gradient is not carried into it")
    D2, E2 = head_dims_inside(backend, domain, D, E)
    if D2 is None:
        pytest.skip(f"{stop}; no head dim of the domain is at least {max(D, E)}")
    T2, S2 = _lengths(domain, T, S)
    if domain.max_t is not None and T2 > domain.max_t:
        pytest.skip(f"{stop}; a call's queries are not split into several calls")
    if T2 > T and _unused_keys(kwargs, T, S):
        # An added query attends keys that no query of the call attends, whose content is
        # then read (SPEC §4.7: the garbage a test puts there is its own business).
        pytest.skip(f"{stop}; the queries it adds would attend keys that no query of it attends")
    options = dict(kwargs)
    if D2 != D and options.get("scale") is None:
        if "scale" not in forms_of(backend):
            pytest.skip(f"{stop}; {name} takes no scale keyword to keep 1/sqrt({D}) at D = {D2}")
        options["scale"] = 1.0 / math.sqrt(D)
    aligned = (
        bool(options.get("is_causal"))
        or options.get("window") not in (None, (None, None), [None, None])
        or options.get("chunk_size") is not None
    )
    front = aligned and options.get("causal_alignment", "top_left") == "bottom_right"
    if front and options.get("chunk_size") is not None and (S2 - S) % options["chunk_size"]:
        pytest.skip(f"{stop}; chunks aligned bottom-right would move")
    if S2 != S:
        options["mask"] = _keys_blocked(backend, stop, options, mask, q, T, S, T2, S2, front)
    elif mask is not None and T2 != T:
        options["mask"] = _padded_mask(np.asarray(mask), T, S, T2, S2, front)
    used = forms_used(options, T2, S2)
    lacking = [f for f in used if f not in forms_of(backend)]
    if lacking:
        pytest.skip(f"{stop}; at T = {T2}, S = {S2} the call would need form {lacking[0]!r}")
    rows = slice(T2 - T, T2) if front else slice(0, T)
    keys = slice(S2 - S, S2) if front else slice(0, S)
    carried = [_pad(q, rows, T2, D2), _pad(k, keys, S2, D2), _pad(v, keys, S2, E2)]
    if vjp:
        carried.append(_pad(args[3], rows, T2, E2))
    out_shape = (*q.shape[:-2], T2, E2)

    def back(result: Any) -> Any:
        if not vjp:
            if getattr(result, "shape", None) != out_shape:
                return result  # the kernel's own shape, for the test to judge
            return np.ascontiguousarray(result[..., rows, :E])
        grads = list(result)
        want = [(*q.shape[:-2], T2, D2), (*k.shape[:-2], S2, D2), (*v.shape[:-2], S2, E2)]
        if len(grads) < 3 or [getattr(g, "shape", None) for g in grads[:3]] != want:
            return result
        dq, dk, dv = grads[:3]
        sliced = [dq[..., rows, :D], dk[..., keys, :D], dv[..., keys, :E]]
        return type(result)([np.ascontiguousarray(g) for g in sliced] + grads[3:])

    return (*carried, *args[len(carried) :]), options, back


def _unused_keys(kwargs: dict, T: int, S: int) -> bool:
    """Whether some key of a call (T, S) is attended by no query (SPEC §4.7)."""
    try:
        seen = visibility(T, S, kwargs)
    except (TypeError, ValueError):  # a malformed option: nothing is carried anyway
        return False
    seen = np.ones((T, S), dtype=bool) if seen is None else seen  # (T, S)
    mask = kwargs.get("mask")
    if mask is not None:
        mask = np.asarray(mask)
        if mask.dtype != np.bool_:
            mask = mask.astype(np.float64) != -np.inf
        seen = seen & mask  # (..., T, S)
    return not seen.any(axis=-2).all()


def inside(domain: Domain, T: int, S: int) -> tuple[int, int]:
    """(T, S) moved into ``domain``'s lengths, keeping T < S, T > S or T = S (where the
    domain allows T ≠ S); an empty length stays empty (its clause is the emptiness)."""
    if T == 0 or S == 0:
        return T, S
    moved = _inside(domain, T, S)
    if domain.max_t is not None and moved[0] > domain.max_t:
        # No move keeps the call's shape under the most queries it takes: the call stays
        # as it is, and its test is skipped by name (a decode kernel's T = 1 stays T = 1).
        return T, S
    return moved


def _inside(domain: Domain, T: int, S: int) -> tuple[int, int]:
    T2, S2 = _lengths(domain, T, S)
    if domain.square:
        return T2, S2
    if T == S:
        n = max(T2, S2)
        while domain.fit_t(n) != n or domain.fit_s(n) != n:
            n = max(domain.fit_t(n), domain.fit_s(n))
        return n, n
    if T < S:
        while S2 <= T2:
            S2 = domain.fit_s(S2 + 1)
    else:
        while T2 <= S2:
            T2 = domain.fit_t(T2 + 1)
    return T2, S2


#: Up to this many positions, a per-position test takes every one of them.
EVERY_POSITION = 32


def positions(backend: Any, n: int, method: str = "attention") -> list[int]:
    """The positions i a per-position test takes (SPEC §4.3's leakage, §12.5's gradient:
    outputs <= i against keys > i): every i < n where n <= ``EVERY_POSITION``, as at the
    suite's own sizes; else, at a size moved inside a kernel's domain, the first two, the
    last and those around each tile edge the domain declares (i = m - 1, m, m + 1 for every
    multiple m of its T and S multiples), where a blockwise kernel's masking changes. Every
    position of an interpreted kernel at S = 128 is minutes per test."""
    if n <= EVERY_POSITION:
        return list(range(n))
    domain = domain_of(backend).of(method)
    edges = {0, 1, n - 1}
    for step in {domain.t_multiple, domain.s_multiple} - {1}:
        for m in range(step, n + 1, step):
            edges |= {m - 1, m, m + 1}
    return sorted(i for i in edges if 0 <= i < n)


def head_dims_inside(backend, domain: Domain, D: int, E: int) -> tuple[int | None, int]:
    if "value_dim" in backend.capabilities:
        D2, E2 = domain.next_head_dim(D), domain.next_head_dim(E)
        return (D2, E2) if D2 is not None and E2 is not None else (None, 0)
    d = domain.next_head_dim(max(D, E))
    return d, d or 0


def _lengths(domain: Domain, T: int, S: int) -> tuple[int, int]:
    T2, S2 = domain.fit_t(T), domain.fit_s(S)
    if domain.square:
        n = max(T2, S2)
        while domain.fit_t(n) != n or domain.fit_s(n) != n:
            n = max(domain.fit_t(n), domain.fit_s(n))
        T2 = S2 = n
    return T2, S2


def _pad(x: np.ndarray, rows: slice, n: int, width: int) -> np.ndarray:
    """``x`` (..., m, w) inside zeros (..., n, width), its rows at ``rows``."""
    out = np.zeros((*x.shape[:-2], n, width), dtype=x.dtype)  # (..., n, width)
    out[..., rows, : x.shape[-1]] = x
    return out


def _padded_mask(mask: np.ndarray, T: int, S: int, T2: int, S2: int, front: bool) -> np.ndarray:
    """The call's mask at (..., T2, S2): added queries attend every real key, added keys are
    blocked (False, or -inf in an additive mask)."""
    full = np.broadcast_to(mask, (*mask.shape[:-2], T, S))  # (..., T, S)
    if mask.dtype == np.bool_:
        attend, blocked = True, False
    else:
        attend, blocked = 0.0, -np.inf
    out = np.full((*mask.shape[:-2], T2, S2), blocked, dtype=mask.dtype)  # (..., T2, S2)
    keys = slice(S2 - S, S2) if front else slice(0, S)
    out[..., keys] = attend
    rows = slice(T2 - T, T2) if front else slice(0, T)
    out[..., rows, keys] = full
    return out


def _keys_blocked(backend, stop, options, mask, q, T, S, T2, S2, front):
    """The mask of a call whose S grows to S2: the added keys blocked by the call's mask,
    by a bool mask built for them, or by top-left causality alone (None)."""
    if mask is not None:
        return _padded_mask(np.asarray(mask), T, S, T2, S2, front)
    forms = forms_of(backend)
    if "mask_bool" in forms:
        return _padded_mask(np.ones((T, S), dtype=bool), T, S, T2, S2, front)
    plain_causal = (
        bool(options.get("is_causal"))
        and options.get("window") in (None, (None, None), [None, None])
        and options.get("chunk_size") is None
        and not front
    )
    if plain_causal and T <= S:
        return None  # every real query lies before the added keys
    pytest.skip(f"{stop}; {backend.name} takes no mask to block the keys that S = {S2} adds")
