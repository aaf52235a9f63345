"""The gradients of ``attention_vjp`` with a misreading planted (SPEC §12), for
``conformance/suite/misreadings_gradients.py``: the departing call (``VjpCall``: the
forward's ``Call``, its d_out, which gradient was compared) and the oracle's float64
textbook backward on it, with changed inputs (``vjp_of``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from conformance.suite.planted import Call

#: The gradients ``attention_vjp`` returns, in its order (SPEC §12.1).
GRADS = ("dq", "dk", "dv", "dmask", "dsinks")


class VjpCall(NamedTuple):
    """A departing ``attention_vjp`` call: its forward ``call``, ``d_out`` (B, H, T, E),
    the name of the gradient compared (``dq``, ``dk``, ``dv``, ``dmask`` or ``dsinks``),
    and the map of the gradients, in ``GRADS``' order, back to the test's shapes (for a
    call carried into a kernel's domain)."""

    call: Call
    d_out: np.ndarray
    name: str
    back: Callable[[Any], Any]


def vjp_of(call: Call, d_out: np.ndarray, back=None, **changes) -> dict[str, np.ndarray]:
    """The float64 textbook gradients of ``call`` for ``d_out``, with ``changes`` to its
    mask or options (a value of None removes the option), mapped by ``back``."""
    from conformance.fixtures import oracle

    mask = changes.pop("mask", call.mask)
    options = {n: x for n, x in {**call.options, **changes}.items() if x is not None}
    with np.errstate(all="ignore"):
        grads = oracle.naive_vjp_same_precision(
            call.q, call.k, call.v, d_out, np.float64, mask=mask, **options
        )
    if back is None:
        return grads
    names = [n for n in GRADS if n in grads]
    return dict(zip(names, back(tuple(grads[n] for n in names))))


def mask_scaled(c: VjpCall) -> np.ndarray | None:
    """The gradient of a function that multiplies the float mask by the scale with the
    scores, ((q·k) + mask) · scale: those of attention with mask · scale, dmask times the
    scale by the chain rule."""
    scale = c.call.scale
    grads = vjp_of(c.call, c.d_out, c.back, mask=c.call.mask * scale)
    if c.name not in grads:
        return None
    return grads[c.name] * (scale if c.name == "dmask" else 1.0)
