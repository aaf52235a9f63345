"""The misreadings of the backward pass (SPEC §12), an area of the one registry
(``conformance/suite/misreadings.py``): a departing gradient of ``attention_vjp`` held
against the gradients of the function with the misreading planted, computed by the
oracle's float64 textbook backward (``conformance/suite/planted_gradients.py``). A
forward's misreading that the backward carries has the forward's sentence, so that the
forward's failures and the gradients' are one finding.
"""

from __future__ import annotations

from conformance.suite.misreading import Misreading
from conformance.suite.misreadings_attention import ATTENTION
from conformance.suite.planted_gradients import mask_scaled

_FORWARD = {m.name: m for m in ATTENTION}

GRADIENTS: tuple[Misreading, ...] = (
    Misreading(
        "grad-float-mask-scaled",
        _FORWARD["float-mask-scaled"].sentence,
        lambda c: c.call.float_mask and c.call.scale != 1.0,
        mask_scaled,
        clauses=("12.1", "12.3", "12.4"),
    ),
)
