"""What a failing test says the function does: one short sentence per distinct behaviour.

A conformance run on someone else's function should read like a bug tracker, not like a
pytest log: "a query with no key to attend returns the mean of V, not 0", "computes
float64 at float32 precision", "raises ValueError: ...". Each failure is reduced to one
such sentence, its *behaviour*; the report and the frameworks table list the distinct
behaviours with the clauses and the number of tests they touch, and a profile's known
failures give them as their reasons. A behaviour names no number that changes between
machines (no error size, no address), so measuring again on another CPU changes no line.

Where the sentence comes from, first match wins:

1. ``SuiteError``: the suite's own bug, said so. Then a known limitation of the
   interpreter the function runs under, where its probe shows it here and it spoils the
   call's dtype (``conformance.adapters.interpreters``): the interpreter's, not the kernel's.
2. An exception the function raised where the spec wants an output: its type and the
   first line of its message, numbers in it replaced by "N" (a section number, §22.10,
   kept).
3. A ``Departure`` raised by the suite's assertions (``conformance/suite/tolerance.py``), which
   carries what it saw: rows that should be 0 because they attend nothing, NaN that
   appeared or vanished, an output that equals a known misreading of attention computed
   by the oracle (``conformance/suite/diagnosis.py``), an error that is exactly what a
   lower precision makes. These causes cut across clauses, so they are named before the
   test's own words.
4. The test's own sentence for what it checks (``behaviour=`` of the assertion).
5. Else: the clause the test checks, by its title: "departs from §2.1 (Batched layout)"
   where the check saw an output that no cause explains, "fails a check of §2.1 (...) that
   saw no output to name a cause by" where it saw none.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from conformance.adapters.interpreters import Limitation, limitation_for
from conformance.suite import diagnosis
from conformance.suite.requirements import SuiteError
from conformance.suite.tolerance import EPS, Departure, Seen

#: The user properties a failing test's report carries: its behaviour, and a few words on
#: its last call (``call_features``, as JSON).
PROPERTY = "conformance-behaviour"
FEATURES = "conformance-call"
#: The sentences of every misreading a failing test's output equals (JSON list), for
#: ``diagnosis.explaining_causes`` to name the run's failures by the cause that explains
#: the most; and, for an output no misreading explains, where its error lies.
MISREADINGS = "conformance-misreadings"
WHERE = "conformance-where"
#: Precisions a float64 result can show instead of its own, most precise first: an error
#: within ``PRECISION_SLACK`` eps of one (scaled by max(1, |expected|)) is that precision.
LOWER_PRECISIONS = {"float64": ("float32",)}
PRECISION_SLACK = 64.0
#: TF32's eps: float32's exponent with a 10-bit mantissa, what a GPU's tensor cores compute
#: a float32 matmul in where allowed. A float32 result within ``PRECISION_SLACK`` of it is
#: "computes float32 in TF32", for a function that runs on a device or declares TF32
#: (SPEC §13.20): on the host, the same error has other causes.
TF32_EPS = 2.0**-10
#: How close to the mean of V a row with no key must be to be called that.
MEAN_OF_V_RTOL = 1e-2

#: The behaviour of a test that was about to call a function with what it does not declare:
#: the suite's bug, never a finding about the function, and never a known failure.
SUITE_BUG = "the suite made a call the function does not declare (a bug in the suite)"


def mark_raised(err: BaseException, backend: str, method: str) -> None:
    """Note on ``err`` that the function under test raised it (not the test's own code)."""
    try:
        err._conformance_raised_by = (backend, method)
    except AttributeError:  # an exception type without instance attributes
        pass


def _first_line(message: str) -> str:
    line = next((part for part in message.strip().splitlines() if part.strip()), "")
    line = re.sub(r"0x[0-9a-fA-F]+", "0x…", line)
    line = re.sub(r"\bnp\.\w+\(([^()]*)\)", r"\1", line)  # np.float64(0.5) reads as 0.5
    # A section number (§22.10) names a clause, not a value: it stays.
    line = re.sub(r"(?<![\w.§])[-+]?\d+(?:\.\d+)?(?:e[-+]?\d+)?(?![\w.])", "N", line)
    return line if len(line) <= 120 else line[:119].rstrip() + "…"


#: ONNX Runtime's wrapper around a kernel's message ("[ONNXRuntimeError] : 2 :
#: INVALID_ARGUMENT : Non-zero status code returned while running X node. Name:'' Status
#: Message: "): the same for every refusal, and long enough to cut the message itself off.
_ORT_WRAPPER = re.compile(
    r"^\[ONNXRuntimeError\] : \d+ : \w+ : "
    r"(?:Non-zero status code returned while running \w+ node\. Name:'[^']*' Status Message: )?"
)


def raised(err: BaseException) -> str:
    """The behaviour of a function that raised ``err`` on an input the spec accepts."""
    text = _first_line(_ORT_WRAPPER.sub("", str(err).strip()))
    return f"raises {type(err).__name__}" + (f": {text}" if text else "")


def _mean_of_v(rows, calls) -> bool:
    """Whether each of ``rows`` ((b, h, t), values) equals the mean of v over every key of
    its batch element and key/value head, in the last call's inputs."""
    if not calls or not rows:
        return False
    _, _, method, args, _ = calls[-1]
    if method not in ("attention", "attention_vjp") or len(args) < 3:
        return False
    q, v = (np.asarray(args[i], dtype=np.float64) for i in (0, 2))
    if q.ndim == 3:
        q, v = q[None], v[None]
    if q.ndim != 4 or v.ndim != 4 or v.shape[2] == 0:
        return False
    H, K = q.shape[1], v.shape[1]
    if K == 0 or H % K:
        return False
    for index, values in rows:
        if len(index) != 3:
            return False
        b, h, _ = index
        mean = v[b, h // (H // K)].mean(axis=0)
        if values.shape != mean.shape or not np.allclose(
            values, mean, rtol=MEAN_OF_V_RTOL, atol=MEAN_OF_V_RTOL
        ):
            return False
    return True


def _precision(seen: Seen, calls) -> str | None:
    """ "computes float64 at float32 precision", when the error fits that exactly."""
    if not calls or seen.nan_where_number or seen.number_where_nan:
        return None
    q = calls[-1][3][0] if calls[-1][3] else None
    dtype = getattr(q, "dtype", None)
    name = None if dtype is None else np.dtype(dtype).name
    for lower in LOWER_PRECISIONS.get(name, ()):
        bound = PRECISION_SLACK * EPS[lower] * max(1.0, seen.scale)
        if seen.tolerance < seen.error <= bound:
            return f"computes {name} at {lower} precision"
    if name == "float32" and _may_compute_in_tf32(calls[-1][1]):
        bound = PRECISION_SLACK * TF32_EPS * max(1.0, seen.scale)
        if seen.tolerance < seen.error <= bound:
            return "computes float32 in TF32"
    return None


def _may_compute_in_tf32(backend) -> bool:
    """Whether ``backend`` runs on a device other than the host's CPU, or declares TF32."""
    device = getattr(backend, "device", None)
    declared = getattr(backend, "float32_matmul", "float32") == "tf32"
    return declared or (bool(device) and str(device).partition(":")[0] != "cpu")


def of_seen(seen: Seen, calls, found: diagnosis.Found | None = None) -> str | None:
    """The cross-cutting cause a comparison shows, if any: a misreading of attention that
    explains the whole output first, since it explains the rows with no key too (``found``:
    the diagnosis of ``seen``, where it was already made)."""
    if seen.actual is not None:
        if found is None:
            found = diagnosis.find(seen.actual, calls, seen.tolerance)
        if found.sentence:
            return found.sentence
    if seen.empty_rows_wrong:
        if calls and calls[-1][2] == "attention_vjp":
            what = "NaN" if seen.nan_in_empty_rows else "not 0"
            return f"a gradient that nothing attended must make exactly 0 is {what}"
        if seen.nan_in_empty_rows:
            return "a query with no key to attend returns NaN, not 0"
        if _mean_of_v(seen.empty_rows, calls):
            return "a query with no key to attend returns the mean of V, not 0"
        return "a query with no key to attend returns a row that is not 0"
    if seen.number_where_nan:
        return "a NaN in the inputs becomes a number in the output"
    return _precision(seen, calls)


def behaviour(err: BaseException | None, calls: list, clause: str | None, title: str) -> str:
    """One sentence for what a failing test found (see the module's docstring).

    ``calls`` are the test's last calls to the backend (``conformance.suite.replay``), oldest
    first; ``clause`` and ``title`` name what the test checks.
    """
    fallback = f"departs from §{clause} ({title})" if clause else "fails"
    if err is None:
        return fallback
    inner = _innermost(err)
    if isinstance(inner, SuiteError):
        return SUITE_BUG
    limitation = _interpreters_limitation(calls)
    if limitation is not None:
        return limitation.sentence
    if getattr(inner, "_conformance_raised_by", None):
        return raised(inner)
    if isinstance(inner, Departure):
        if inner.seen is None:
            # No output to hold against the misreadings: the clause is not the cause.
            return inner.behaviour or (unseen(clause, title) if clause else fallback)
        cause = of_seen(inner.seen, calls, _found(inner, calls))
        return cause or inner.behaviour or fallback
    if type(inner).__name__ == "Failed" and str(inner).startswith("Timeout"):
        return "hangs: no answer within the time limit"
    return fallback


def _interpreters_limitation(calls: list) -> Limitation | None:
    """The known limitation of the interpreter the last call's function runs under, where
    its probe shows it here and it spoils the call's dtype (SPEC §13.19)."""
    if not calls:
        return None
    _, backend, _, args, _ = calls[-1]
    interpreter = getattr(backend, "interpreter", "")
    dtype = getattr(args[0], "dtype", None) if args else None
    if not interpreter or dtype is None:
        return None
    return limitation_for(interpreter, np.dtype(dtype).name)


def unseen(clause: str, title: str) -> str:
    """The behaviour of a failing check of ``clause`` that carried no output (a
    ``Departure`` without ``seen`` or a sentence of its own): said so, since no cause
    could be named from it."""
    return f"fails a check of §{clause} ({title}) that saw no output to name a cause by"


def _found(departure: Departure, calls) -> diagnosis.Found:
    """The diagnosis of a departure's output, made once and kept on the departure."""
    found = getattr(departure, "_conformance_found", None)
    if found is None:
        seen = departure.seen
        found = diagnosis.NOTHING
        if seen is not None and seen.actual is not None:
            found = diagnosis.find(seen.actual, calls, seen.tolerance)
        departure._conformance_found = found
    return found


def misreadings(err: BaseException | None, calls: list) -> list[str]:
    """The sentences of every misreading of attention that a failing test's output equals
    (``diagnosis.find``), in ``misreadings.MISREADINGS``' order; [] where none does, the
    failure saw no output, or a known limitation of its interpreter spoiled it (the run
    must not name it by a misreading of the kernel's)."""
    inner = _innermost(err) if err is not None else None
    if not isinstance(inner, Departure) or _interpreters_limitation(calls) is not None:
        return []
    return list(_found(inner, calls).matches)


def where(err: BaseException | None, calls: list) -> str | None:
    """For a failing comparison that no misreading explains: which batch elements, heads,
    rows and channels hold the error, and which options, left out, bring the output
    nearer (``diagnosis_readers.where_it_departs``); None otherwise."""
    inner = _innermost(err) if err is not None else None
    if not isinstance(inner, Departure):
        return None
    return _found(inner, calls).where


def _innermost(err: BaseException) -> BaseException:
    """The failure itself, out of an exception group's wrapping (Hypothesis reports several
    distinct failures of one test as a group): its first member."""
    while getattr(err, "exceptions", None):
        err = err.exceptions[0]
    return err


#: Behaviours of one family, listed on one line with their details: refusals of bad input
#: (SPEC §8.1) are one finding each, but a reader wants them side by side.
FAMILIES = (
    (re.compile(r"^accepts (?P<what>.+) \(no error\)$"), "accepts, with no error,"),
    (
        re.compile(r"^raises (?P<got>\w+), not (?P<want>\w+), for (?P<what>.+)$"),
        "raises {got}, not {want}, for",
    ),
)


def family(text: str) -> tuple[str, str]:
    """(the line a behaviour is listed under, its detail): "accepts scale = 0 (no error)"
    is listed as "accepts, with no error," with the detail "scale = 0"; a behaviour of no
    family is its own line, with no detail."""
    for pattern, line in FAMILIES:
        found = pattern.match(text)
        if found:
            return line.format(**found.groupdict()), found["what"]
    return text, ""


def call_features(calls: list) -> list[str]:
    """A few words on the last call a test made (its dtype, empty sequences, the mask and
    options), for the report to say what every call of a behaviour had in common."""
    if not calls:
        return []
    _, _, method, args, kwargs = calls[-1]
    found: list[str] = []
    if method == "attention_vjp":
        found.append("backward")
    arrays = [a for a in args[:3] if isinstance(a, np.ndarray)]
    if len(arrays) == 3:
        q, k, v = arrays
        found.append(q.dtype.name)
        if q.ndim >= 2 and q.shape[-2] == 0:
            found.append("T = 0")
        if k.ndim >= 2 and k.shape[-2] == 0:
            found.append("S = 0")
        if q.ndim == 3:
            found.append("unbatched")
    mask = kwargs.get("mask")
    if isinstance(mask, np.ndarray):
        kind = {"b": "bool", "f": "float", "V": "float"}.get(mask.dtype.kind, mask.dtype.name)
        found.append(f"{kind} mask")  # ml_dtypes' bfloat16 is of kind "V"
    for name, value in kwargs.items():
        if name in ("mask", "scale", "seed"):
            continue
        if isinstance(value, np.ndarray):  # an array option (sinks): used when given
            found.append(name)
            continue
        if value not in (None, False, 0.0, "top_left"):
            found.append(name if name != "causal_alignment" else str(value))
    return found


def describe_common(features: list[list[str]]) -> str:
    """ "every call: float16, S = 0" for what all of ``features`` share, or ""."""
    if not features:
        return ""
    common = [f for f in features[0] if all(f in other for other in features[1:])]
    return f"every call: {', '.join(common)}" if common else ""


def as_text(value: Any) -> str:
    """A behaviour as the one line it is stored as (a known-failure reason)."""
    return " ".join(str(value).split())
