"""A correct attention function that declares little, and writes down every call it gets.

The reference implementation behind a plain function that the project's test plugs in
with ``--impl`` and few declarations (``tests/test_requirements.py``): with
``LIMITED_ATTENTION_LOG`` set, each call appends one JSON line describing its inputs, so
the test can read back everything the suite handed the function.
"""

from __future__ import annotations

import json
import os

import numpy as np
from conformance.impls.numpy.attention import attention as reference


def _describe(x) -> dict | None:
    if x is None:
        return None
    x = np.asarray(x)
    return {"dtype": x.dtype.name, "shape": list(x.shape)}


def attention(q, k, v, **options):
    log = os.environ.get("LIMITED_ATTENTION_LOG")
    if log:
        call = {
            "q": _describe(q),
            "k": _describe(k),
            "v": _describe(v),
            "mask": _describe(options.get("mask")),
            "options": sorted(n for n in options if n != "mask"),
        }
        with open(log, "a") as f:
            f.write(json.dumps(call) + "\n")
    seed = options.pop("seed", None)
    if seed is not None:
        options["rng"] = np.random.default_rng(seed)  # the reference draws dropout from an rng
    return reference(q, k, v, **options)
