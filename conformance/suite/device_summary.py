"""What a device changes, said in the run's summary (SPEC §13.20): for each function that
runs on a named device, the framework's settings that let it compute float32 in less (TF32,
reduced-precision reductions), what its profile declares it does, and whether a call
repeated on the same inputs gives the same bits."""

from __future__ import annotations

from typing import Any

import numpy as np

from conformance.suite.behaviours import raised
from conformance.suite.domain import domain_of

#: How many times a call is repeated to see whether it is bitwise reproducible (as
#: FlashAttention's own tests repeat theirs).
REPEATS = 10
#: The repeated call's sizes: B, H, T = S, D (moved into the function's domain).
REPEATED = {"B": 2, "H": 4, "T": 128, "D": 64}


def on_a_device(backend: Any) -> bool:
    """Whether ``backend`` runs on a device it names (``--impl-device``, a profile's)."""
    return bool(getattr(backend, "device", None))


def device_words(backend: Any) -> list[str]:
    """The summary's lines on where ``backend`` runs and the settings it ran under."""
    arrays = getattr(backend, "arrays", None)
    settings = arrays.precision_settings() if arrays is not None else {}
    shown = ", ".join(f"{name} = {value}" for name, value in settings.items())
    lines = [f"runs on {backend.device}" + (f" with {shown}" if shown else "")]
    declared = getattr(backend, "float32_matmul", "float32")
    lines.append(f"declares float32 matmuls in {declared}")
    return lines


def _repeated_call(backend: Any) -> tuple[tuple[np.ndarray, ...], dict]:
    """Inputs for the repeated call, inside the function's domain, in its first dtype."""
    domain = domain_of(backend)
    T = max(domain.fit_t(REPEATED["T"]), domain.fit_s(REPEATED["T"]))
    D = domain.next_head_dim(REPEATED["D"]) or REPEATED["D"]
    dtype = backend.dtypes[0] if "float32" not in backend.dtypes else "float32"
    from conformance.vocabulary import numpy_dtype

    rng = np.random.default_rng(0)
    shape = (REPEATED["B"], REPEATED["H"], T, D)  # q, k, v: (B, H, T, D), T = S
    q, k, v = (rng.standard_normal(shape).astype(numpy_dtype(dtype)) for _ in range(3))
    causal = getattr(getattr(backend, "call", None), "causal", "keyword") == "only"
    return (q, k, v), ({"is_causal": True} if causal else {})


def reproducible(backend: Any, repeats: int = REPEATS) -> str:
    """Whether ``repeats`` calls of ``backend.attention`` on the same inputs give the same
    bits, in words: "bitwise reproducible in 10 calls", or how many calls differed from
    the first and by how much, or why it could not be measured."""
    (q, k, v), options = _repeated_call(backend)
    try:
        outs = [np.asarray(backend.attention(q, k, v, **options)) for _ in range(repeats)]
    except Exception as err:
        return f"its reproducibility could not be measured: it {raised(err)}"
    first = outs[0].view(np.uint8)
    differ = [o for o in outs[1:] if o.shape != outs[0].shape or (o.view(np.uint8) != first).any()]
    B, H, T, D = q.shape
    call = f"attention at B={B}, H={H}, T=S={T}, D={D}, {q.dtype.name}"
    if not differ:
        return f"bitwise reproducible: {repeats} calls of {call} gave the same bits"
    with np.errstate(invalid="ignore"):
        most = max(
            float(np.nanmax(np.abs(o.astype(np.float64) - outs[0].astype(np.float64))))
            for o in differ
            if o.shape == outs[0].shape
        )
    return (
        f"not bitwise reproducible: {len(differ)} of {repeats - 1} repeated calls of {call} "
        f"differ from the first, by up to {most:.3g}"
    )


class DeviceSummary:
    """The summary's lines for the functions that run on a device. A plugin of its own."""

    def __init__(self, backends: list[Any]) -> None:
        self.backends = [b for b in backends if on_a_device(b)]

    def pytest_terminal_summary(self, terminalreporter) -> None:
        for backend in self.backends:
            for line in [*device_words(backend), reproducible(backend)]:
                terminalreporter.write_line(f"{backend.name}: {line}")
