"""What a test needs, declared beside it, and held against what a backend declares.

A conformance test never decides in its body whether it may run. It declares what its
inputs use, and the harness (``conformance/tests/conftest.py``) skips it, naming what is
missing, for a backend that does not declare it (SPEC §10.3)::

    @requires("gqa", "window")                        # capabilities the test's calls use
    @pytest.mark.parametrize("dtype", DTYPES)         # a dtype parameter, or per case:
    pytest.param(case_id, marks=uses_dtype("float16"))
    @refuses("window")                                # SPEC §8.5: runs where NOT declared
    @requires("causal", "scale")                      # forms of the core (SPEC §13.17)

Beside the capabilities, ``requires`` names the forms of the core a function may not take
(``conformance.adapters.forms.FORMS``: ``causal``, ``causal_top_left``, ``window_right``,
``scale``); a backend that does not say takes them all. ``causal_top_left`` is needed only
where T ≠ S: a test whose ``size`` parameter (or ``T`` and ``S`` parameters) has T = S
does not need it.

A test without a dtype of its own takes the ``dtype`` fixture: the most precise dtype its
backends all declare. ``requires`` and ``uses_dtype`` check their names against the
vocabulary when the test module is imported, so a misspelt capability is a collection
error, never a test that silently never runs.

Behind the declarations stands a guard: every call a test makes goes through
``undeclared``, which names anything in it the backend did not declare (a dtype, E ≠ D,
unbatched or grouped inputs, an option, a form of the core, a backward pass). Such a call is the suite's bug,
not the backend's, and raises ``SuiteError`` instead of reaching the backend. Only a test
marked ``refuses`` or ``refusal`` (SPEC §8.5: what is undeclared must be refused) may make
one.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import pytest

from conformance.adapters.forms import CALL_FORMS, FORMS, forms_of, forms_used
from conformance.backends import CAPABILITIES, DTYPES
from conformance.vocabulary import OPTION_CAPABILITIES as VOCABULARY_OPTION_CAPABILITIES
from conformance.vocabulary import OPTION_DEFAULTS

#: The option each optional capability governs, with the value that means "not used".
OPTION_CAPABILITIES = {
    option: (capability, OPTION_DEFAULTS[option])
    for option, capability in VOCABULARY_OPTION_CAPABILITIES.items()
}
#: What a backward call needs beyond "grad", by option.
GRAD_OPTION_CAPABILITIES = {"softcap": ("grad_softcap", None)}


class SuiteError(Exception):
    """The suite was about to call a backend with something it does not declare.

    A bug in a test, never a finding about the backend: the call is not made.
    """


def _check_capabilities(names: Iterable[str]) -> tuple[str, ...]:
    names = tuple(names)
    unknown = [n for n in names if n not in CAPABILITIES and n not in FORMS]
    if unknown:
        raise ValueError(
            f"unknown capabilities {unknown} in a test's requirements; known: "
            f"{sorted(CAPABILITIES)} and the forms {sorted(FORMS)}"
        )
    return names


def requires(*capabilities: str) -> pytest.MarkDecorator:
    """The mark of a test (or of one parameter set) whose calls use ``capabilities``."""
    return pytest.mark.requires(*_check_capabilities(capabilities))


def uses_dtype(*dtypes: str) -> pytest.MarkDecorator:
    """The mark of a parameter set whose arrays are of ``dtypes`` (a fixture case's dtype,
    a float mask's)."""
    unknown = [d for d in dtypes if d not in DTYPES]
    if unknown:
        raise ValueError(f"unknown dtypes {unknown} in a test's requirements; known: {DTYPES}")
    return pytest.mark.dtypes(*dtypes)


def refuses(capability: str) -> pytest.MarkDecorator:
    """The mark of a test that checks an undeclared ``capability`` is refused (SPEC §8.5):
    it runs only where the backend does not declare it."""
    return pytest.mark.refuses(*_check_capabilities([capability]))


def item_needs(item: pytest.Item) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(the capabilities, the dtypes) a collected test declares: its ``requires`` marks,
    its ``dtype`` parameter and its ``dtypes`` marks. A test taking the ``dtype`` fixture
    instead gets a dtype its backends declare."""
    caps: list[str] = []
    # Outermost first (module, then function, then parameter set): a skip names the
    # broadest need a backend lacks.
    for mark in reversed(list(item.iter_markers("requires"))):
        caps += _check_capabilities(mark.args)
    params = getattr(getattr(item, "callspec", None), "params", {})
    if "causal_top_left" in caps and _square(params):
        caps = [c for c in caps if c != "causal_top_left"]
    dtypes = [params["dtype"]] if isinstance(params.get("dtype"), str) else []
    for mark in item.iter_markers("dtypes"):
        dtypes += mark.args
    unknown = [d for d in dtypes if d not in DTYPES]
    if unknown:
        raise ValueError(f"unknown dtypes {unknown}; known: {DTYPES}")
    return tuple(dict.fromkeys(caps)), tuple(dict.fromkeys(dtypes))


def _square(params: Mapping[str, Any]) -> bool:
    """Whether a test's parameters fix T = S (a ``size`` dict, or ``T`` and ``S``)."""
    size = params.get("size")
    if isinstance(size, Mapping) and "T" in size and "S" in size:
        return size["T"] == size["S"]
    T, S = params.get("T"), params.get("S")
    return isinstance(T, int) and isinstance(S, int) and T == S


def lacking(backend: Any, capabilities: Iterable[str], dtypes: Iterable[str]) -> str | None:
    """Why ``backend`` cannot run a test needing these: "<name> lacks capability 'x'",
    "<name> lacks form 'f': what it is" or "<name> lacks dtype 'd'", or None."""
    forms = forms_of(backend)
    for cap in capabilities:
        if cap not in FORMS and cap not in backend.capabilities:
            return f"{backend.name} lacks capability {cap!r}"
    # Forms after capabilities: a test of a capability the backend lacks is skipped for
    # that, not for a form (a run's summary counts the clauses a form leaves untested).
    for cap in capabilities:
        if cap in FORMS and cap not in forms:
            return f"{backend.name} lacks form {cap!r}: {FORMS[cap]}"
    for dtype in dtypes:
        if dtype not in backend.dtypes:
            return f"{backend.name} lacks dtype {dtype!r}"
    return None


def declared_refusal(backend: Any, item: pytest.Item) -> str | None:
    """Why a ``refuses`` test cannot run on ``backend`` (it declares the capability), or None."""
    for mark in item.iter_markers("refuses"):
        for cap in mark.args:
            if cap in backend.capabilities:
                return f"{backend.name} declares {cap!r}, so there is nothing to refuse"
    return None


def common_dtype(backends: Iterable[Any]) -> str | None:
    """The most precise dtype every one of ``backends`` declares, or None."""
    backends = list(backends)
    for dtype in DTYPES:
        if all(dtype in b.dtypes for b in backends):
            return dtype
    return None


def value_dims(backends: Any, D: int, E: int, *, keep: str = "D") -> tuple[int, int]:
    """(D, E) for a test's inputs: as asked when every backend declares "value_dim", else
    one head dim for both: the D asked for (``keep="D"``) or the E (``keep="E"``, for the
    tests whose V is an identity matrix and so needs E = S)."""
    if not isinstance(backends, (list, tuple)):
        backends = [backends]
    if E == D or all("value_dim" in b.capabilities for b in backends):
        return D, E
    return (E, E) if keep == "E" else (D, D)


def _float_dtype(x: Any) -> str | None:
    if x is None or not hasattr(x, "dtype"):
        return None
    dtype = np.dtype(x.dtype)
    name = "bfloat16" if dtype.name == "bfloat16" else dtype.name
    return name if name in DTYPES else None


def undeclared(backend: Any, method: str, args: tuple, kwargs: Mapping[str, Any]) -> list[str]:
    """What a call of ``backend.method(*args, **kwargs)`` uses that the backend does not
    declare: dtypes of q and of a floating mask, E ≠ D, unbatched or grouped inputs, the
    options of optional capabilities, a backward pass and its options. Empty when all is
    declared. Malformed inputs (a rank or a size that is wrong on purpose) are not judged
    here: refusing them is the backend's part (SPEC §8.1)."""
    if method in ("attention_paged", "attention_paged_vjp"):
        return _undeclared_paged(backend, method, args, kwargs)
    if method == "merge_states":
        return _undeclared_merge(backend, args)
    packed = method in ("attention_packed", "attention_packed_vjp")
    if method not in ("attention", "attention_vjp") and not packed:
        return []
    caps, dtypes = backend.capabilities, backend.dtypes
    found: list[str] = []
    if packed and "packed" not in caps:
        found.append(f"{method} (capability 'packed')")
    q, k, v = (np.asarray(x) if isinstance(x, np.ndarray) else x for x in args[:3])
    dtype = _float_dtype(q)
    if dtype is not None and dtype not in dtypes:
        found.append(f"dtype {dtype!r}")
    mask = kwargs.get("mask")
    mask_dtype = _float_dtype(mask)
    if mask_dtype is not None and mask_dtype not in dtypes:
        found.append(f"a {mask_dtype} mask")
    shapes = [getattr(x, "shape", None) for x in (q, k, v)]
    if all(s is not None and len(s) >= 2 for s in shapes):
        (qs, ks, vs) = shapes
        if len(qs) == len(ks) == len(vs) and qs[-1] == ks[-1] and vs[-1] != qs[-1]:
            if "value_dim" not in caps:
                found.append(f"E = {vs[-1]} ≠ D = {qs[-1]} (capability 'value_dim')")
        # Packed calls have the unbatched layout by definition (SPEC §18.1).
        if len(qs) == 3 and len(ks) == len(vs) == 3 and "unbatched" not in caps and not packed:
            found.append("unbatched inputs (capability 'unbatched')")
        if len(qs) >= 3 and len(ks) == len(qs) and len(vs) == len(qs):
            H, K = qs[-3], ks[-3]
            if K != H and K > 0 and H % K == 0 and vs[-3] == K and "gqa" not in caps:
                found.append(f"K = {K} < H = {H} (capability 'gqa')")
    for option, (cap, default) in OPTION_CAPABILITIES.items():
        if option in kwargs and _differs(kwargs[option], default) and cap not in caps:
            found.append(f"{option}={kwargs[option]!r} (capability {cap!r})")
    # A packed call's T and S are its documents', not the arrays': alignment assumed.
    found += _undeclared_forms(backend, [None, None] if packed else shapes, kwargs)
    if method in ("attention_vjp", "attention_packed_vjp"):
        if "grad" not in caps:
            found.append(f"{method} (capability 'grad')")
        for option, (cap, default) in GRAD_OPTION_CAPABILITIES.items():
            if option in kwargs and _differs(kwargs[option], default) and cap not in caps:
                found.append(f"{option} in attention_vjp (capability {cap!r})")
    return found


def _undeclared_merge(backend: Any, args: tuple) -> list[str]:
    """What a ``merge_states`` call uses that ``backend`` does not declare: the capability
    and the outputs' dtype (SPEC §22)."""
    found = [] if "merge" in backend.capabilities else ["merge_states (capability 'merge')"]
    dtype = _float_dtype(args[0]) if args else None
    if dtype is not None and dtype not in backend.dtypes:
        found.append(f"dtype {dtype!r}")
    return found


def _undeclared_forms(backend: Any, shapes: list, kwargs: Mapping[str, Any]) -> list[str]:
    """The forms of the core (``is_causal``, top-left alignment with T ≠ S, a window's right
    side, ``scale``) that a call uses and ``backend`` does not take."""
    q, k = shapes[0], shapes[1]
    sizes = (
        (q[-2], k[-2]) if q is not None and k is not None and len(q) >= 2 and len(k) >= 2 else ()
    )
    takes = forms_of(backend)
    try:
        used = forms_used(kwargs, *sizes)
    except (TypeError, ValueError):  # a malformed option, for the backend to refuse
        return []
    # The forms no test declares are the guard's to skip, not errors (suite/domain.py).
    return [f"form {f!r} ({FORMS[f]})" for f in used if f not in takes and f not in CALL_FORMS]


def _undeclared_paged(
    backend: Any, method: str, args: tuple, kwargs: Mapping[str, Any]
) -> list[str]:
    """``undeclared`` for the paged entry points (SPEC §19): "paged" itself, the dtype,
    E ≠ D and K < H of the pages, the window and softcap, and for the backward "grad"
    (and "grad_softcap")."""
    caps = backend.capabilities
    found = [] if "paged" in caps else [f"{method} (capability 'paged')"]
    q, k_pages, v_pages = args[:3]
    dtype = _float_dtype(q)
    if dtype is not None and dtype not in backend.dtypes:
        found.append(f"dtype {dtype!r}")
    shapes = [getattr(x, "shape", None) for x in (q, k_pages, v_pages)]
    if all(s is not None and len(s) == 4 for s in shapes):
        qs, ks, vs = shapes
        if qs[-1] == ks[-1] and vs[-1] != qs[-1] and "value_dim" not in caps:
            found.append(f"E = {vs[-1]} ≠ D = {qs[-1]} (capability 'value_dim')")
        H, K = qs[1], ks[1]
        if K != H and K > 0 and H % K == 0 and "gqa" not in caps:
            found.append(f"K = {K} < H = {H} (capability 'gqa')")
    for option in ("window", "softcap"):
        cap, default = OPTION_CAPABILITIES[option]
        if option in kwargs and _differs(kwargs[option], default) and cap not in caps:
            found.append(f"{option}={kwargs[option]!r} (capability {cap!r})")
    if method == "attention_paged_vjp":
        if "grad" not in caps:
            found.append("attention_paged_vjp (capability 'grad')")
        if _differs(kwargs.get("softcap"), None) and "grad_softcap" not in caps:
            found.append("softcap in attention_paged_vjp (capability 'grad_softcap')")
    return found


def _differs(value: Any, default: Any) -> bool:
    if default is None:
        return value is not None  # an array option (sinks) has no truth value of its own
    try:
        return bool(value != default)
    except (TypeError, ValueError):
        return True
