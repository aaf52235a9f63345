"""What the tests of SPEC §20 share: the operands they quantise, the derived tolerance, and
which backends run which sections.

The suite makes the codes and descales itself (SPEC §20.7): a backend, or a user's
function through its profile, declares the formats and granularities it takes, and the
tests hand it exactly those. The expected output is the oracle on the dequantised
operands (``conformance.fixtures.quantized``); the tolerance is §20.6's, from the
declared P pipeline run plainly on the same operands.
"""

from __future__ import annotations

import numpy as np
import pytest

from conformance.fixtures import quantized as fq
from conformance.suite.helpers import oracle_attention
from conformance.suite.tolerance import EPS, FACTOR, FLOOR, finite_error
from conformance.vocabulary import P_PIPELINES

#: The float32 floor of SPEC §7.1: the steps around P are float32 in every pipeline.
FLOOR32 = FLOOR["float32"] * EPS["float32"]


def outside_sections(backend, item: pytest.Item) -> str | None:
    """Why ``backend`` does not run ``item``: it declares ``sections`` (the quantized
    backends run SPEC §20 alone) and the item's clause lies in none of them."""
    sections = getattr(backend, "sections", ())
    if not sections:
        return None
    marker = item.get_closest_marker("clause")
    clauses = marker.args if marker else ()
    if any(str(c).split(".")[0] in sections for c in clauses):
        return None
    what = " (quantized operands)" if "20" in sections else ""
    return f"{backend.name} runs SPEC §{', §'.join(sections)} only{what}"


def quantise(
    x: np.ndarray, fmt: str, granularity: str, *, block_size=None, K=None, rng=None, room=1.0
):
    """Codes and a float32 descale of x (B, N, S, ·) at ``granularity`` (SPEC §20.2).

    The descale is amax / the format's largest value over each group, times a factor drawn
    in [1.05, 1.45] or [1.55, 1.95] (never 1, different per group) so that a descale
    dropped, replaced by 1, applied twice or taken from another head changes the answer;
    a factor above 1 keeps every code inside the format, so no code saturates. ``room``
    multiplies the factor: with 2, every code can be doubled and stay inside.
    For q, whose descale is per key/value head, ``K`` groups the heads."""
    x = np.asarray(x, dtype=np.float64)
    B, N, S = x.shape[:3]
    if granularity == "tensor":
        groups = x.reshape(1, 1, -1)
    elif granularity == "head":
        groups = x.reshape(B, K or N, -1)
    elif granularity == "token":
        groups = x.reshape(B, N, S, -1)
    else:
        n = -(-S // block_size)
        pad = np.zeros((B, N, n * block_size - S, x.shape[3]))
        groups = np.concatenate([x, pad], axis=2).reshape(B, N, n, -1)
    amax = np.abs(groups).max(axis=-1)
    rng = rng or np.random.default_rng(0)
    jitter = rng.uniform(1.05, 1.45, amax.shape) + rng.integers(0, 2, amax.shape) * 0.5
    jitter = jitter * room
    descale = (np.where(amax > 0, amax, 1.0) / fq.LARGEST[fmt] * jitter).astype(np.float32)
    if granularity == "tensor":
        descale = descale.reshape(())
    full = fq.expand_descale(
        descale if granularity != "head" or K is None else np.repeat(descale, N // K, axis=1),
        B,
        N,
        S,
        block_size,
    )
    codes = fq.cast(x / full[..., None], fmt, "saturate")
    return codes, descale


def bound(actual_pipeline: np.ndarray, expected: np.ndarray) -> float:
    """SPEC §20.6: 2 · max |pipeline − oracle| + 8 · 2⁻²³ · max(1, max |oracle|)."""
    expected = np.asarray(expected, dtype=np.float64)
    scale = max(1.0, float(np.max(np.abs(expected[np.isfinite(expected)]), initial=0.0)))
    return FACTOR * finite_error(actual_pipeline, expected) + FLOOR32 * scale


def expected(operands: dict, **options) -> np.ndarray:
    """The oracle on the dequantised operands (SPEC §20.3), kept for the process like every
    oracle result the suite asks for (``helpers.oracle_attention``)."""
    L = operands.get("block_size")
    return oracle_attention(
        fq.dequantize(operands["q"], operands["q_descale"]),
        fq.dequantize(operands["k"], operands["k_descale"], L),
        fq.dequantize(operands["v"], operands["v_descale"], L),
        **options,
    )


def expected_and_bound(backend, operands: dict, **options) -> tuple[np.ndarray, float]:
    """The oracle on the dequantised operands and §20.6's bound for ``backend``'s pipeline."""
    y = expected(operands, **options)
    return y, declared_bound(backend, operands, y, **options)


def declared_bound(backend, operands: dict, y: np.ndarray, **options) -> float:
    """§20.6's bound for ``backend``'s declared pipeline with its parameters (its lift,
    tile and accumulator, SPEC §20.9), y being the oracle's answer."""
    form = backend.quantized
    parameters = {
        "lift": getattr(form, "lift", None),
        "tile": getattr(form, "tile", None),
        "accumulator": getattr(form, "accumulator", "float32"),
    }
    return pipeline_bound(operands, y, form.pipeline, **parameters, **options)


def pipeline_bound(operands: dict, y: np.ndarray, p_pipeline: str, **options) -> float:
    """§20.6's bound on ``operands`` under ``p_pipeline``, y being the oracle's answer;
    ``options`` may hold the pipeline's parameters (``fq.pipeline``'s lift, tile and
    accumulator)."""
    run = fq.pipeline(
        *_args(operands), p_pipeline, block_size=operands.get("block_size"), **options
    )
    return bound(run, y)


def pipeline_bounds(operands: dict, y: np.ndarray, backend=None, **options) -> dict[str, float]:
    """§20.6's bound on ``operands`` under every P pipeline: what declaring each costs on
    this very case, for the report (SPEC §20.6); ``backend``'s own pipeline with its
    declared parameters."""
    found = {p: pipeline_bound(operands, y, p, **options) for p in P_PIPELINES}
    if backend is not None:
        found[backend.quantized.pipeline] = declared_bound(backend, operands, y, **options)
    return found


def _args(o: dict) -> tuple:
    return o["q"], o["k"], o["v"], o["q_descale"], o["k_descale"], o["v_descale"]


#: What the calls of this process handed each quantized backend, drained into each test's
#: report (``conformance/tests/conftest.py``) for the run's summary: (backend, [words]).
EXERCISED: list[tuple[str, list[str]]] = []


def exercised(operands: dict, options: dict) -> list[str]:
    """What a call hands a function, in the words of its declaration: each operand's
    format and granularity, the options it sets, the output's format."""
    words = []
    for role in "qkv":
        fmt = np.asarray(operands[role]).dtype.name
        ndim = np.ndim(operands[f"{role}_descale"])
        gran = {0: "tensor", 2: "head"}.get(ndim)
        if gran is None:
            gran = "block" if operands.get("block_size") and role != "q" else "token"
        words.append(f"{role} in {fmt} per {gran}")
    words += [f"the option {o}" for o in options if o not in ("out_descale", "out_format")]
    if options.get("out_format") is not None:
        words.append(f"an output in {options['out_format']}")
    return words


def unexercised(backend, seen: set[str]) -> list[str]:
    """What ``backend`` declares (formats and granularities of q, k and v, the options it
    takes, its output formats) that no call of the run handed it."""
    form = backend.quantized
    declared = [
        f"{r} in {f} per {g}" for r in "qkv" for f in form.formats[r] for g in form.granularities[r]
    ]
    takes = getattr(backend, "takes", None) or ()
    declared += [
        f"the option {o}"
        for o in sorted(takes)
        if o not in ("out_descale", "out_format", "causal_alignment")
    ]
    declared += [f"an output in {f}" for f in form.out_formats]
    return [d for d in declared if d not in seen]


def call(backend, operands: dict, **options) -> np.ndarray:
    """``backend.attention_quantized`` on ``operands``, float64 out; a test whose options a
    function's profile does not take (a mask) is skipped, naming it (SPEC §20.7)."""
    if getattr(backend, "quantizes", False):
        pytest.skip(
            f"{backend.name} quantizes its own inputs: the suite cannot hand it codes, and "
            "judges it on §20.4's no future leakage alone"
        )
    takes = getattr(backend, "takes", None)
    if takes is not None:
        # The output's format goes with its descale: a function of one format takes none.
        for option in set(options) - {"out_format"}:
            if option not in takes:
                pytest.skip(f"{backend.name} takes no {option} (its profile's [quantized] options)")
    EXERCISED.append((backend.name, exercised(operands, options)))
    return np.asarray(
        backend.attention_quantized(
            operands["q"],
            operands["k"],
            operands["v"],
            q_descale=operands["q_descale"],
            k_descale=operands["k_descale"],
            v_descale=operands["v_descale"],
            block_size=operands.get("block_size"),
            **options,
        ),
        dtype=np.float64,
    )


#: The format and granularity the tests use where any declared one will do:
#: FlashAttention-3's, where the backend declares it; the block length of "block".
PREFERRED = ("float8_e4m3fn", "head")
BLOCK = 4


def declared_form(backend) -> tuple[tuple[str, ...], tuple[str, ...], int | None]:
    """(formats, granularities, block length) of q, k and v in a form ``backend`` declares:
    FlashAttention-3's per-head e4m3 for each operand where it declares it, else its first
    declared format and granularity, so that a test that needs no particular form hands a
    function only codes it takes (SPEC §20.7)."""
    form = backend.quantized
    formats = tuple(
        PREFERRED[0] if PREFERRED[0] in form.formats[r] else form.formats[r][0] for r in "qkv"
    )
    granularities = tuple(
        PREFERRED[1] if PREFERRED[1] in form.granularities[r] else form.granularities[r][0]
        for r in "qkv"
    )
    return formats, granularities, BLOCK if "block" in granularities else None


def operands_for(backend, seed: int, **sizes) -> dict:
    """``operands`` in the form ``declared_form`` picks for ``backend``."""
    formats, granularities, L = declared_form(backend)
    return operands(seed, formats=formats, granularities=granularities, block_size=L, **sizes)


def supported(backend, role: str, fmt: str, granularity: str) -> bool:
    form = backend.quantized
    return fmt in form.formats[role] and granularity in form.granularities[role]


def operands(
    seed: int,
    *,
    B=2,
    H=4,
    K=2,
    T=7,
    S=11,
    D=8,
    E=8,
    formats=("float8_e4m3fn",) * 3,
    granularities=("head", "head", "head"),
    block_size=None,
    q_spread=2.0,
    k_spread=1.0,
    room=1.0,
) -> dict:
    """Random q, k, v quantised at the given formats and granularities (SPEC §20.2)."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, H, T, D)) * q_spread
    k = rng.standard_normal((B, K, S, D)) * k_spread
    v = rng.standard_normal((B, K, S, E))
    out = {"block_size": block_size}
    for role, x, fmt, gran in zip("qkv", (q, k, v), formats, granularities):
        codes, descale = quantise(x, fmt, gran, block_size=block_size, K=K, rng=rng, room=room)
        out[role], out[f"{role}_descale"] = codes, descale
    return out


def growing_scores(seed: int, backend=None) -> dict:
    """Operands whose scores (at scale 1) grow key after key from about 6 to 64, with every
    key on one line through the origin: each tile's row maximum is above the last's, so a
    kernel that rounds P at a stale maximum pushes P · 2⁸ past e4m3's 448 (SPEC §20.4).
    In ``backend``'s declared form (``declared_form``), FlashAttention-3's without one."""
    formats, granularities, L = (
        declared_form(backend)
        if backend is not None
        else (("float8_e4m3fn",) * 3, ("head",) * 3, None)
    )
    o = operands(
        seed,
        B=1,
        H=2,
        K=1,
        T=3,
        S=128,
        D=8,
        E=8,
        formats=formats,
        granularities=granularities,
        block_size=L,
    )
    rng = np.random.default_rng(seed + 1)
    u = rng.standard_normal(8)
    u /= np.linalg.norm(u)
    k = np.linspace(0.1, 1.0, 128)[:, None] * u * 8.0  # (S, D)
    q = np.broadcast_to(u * 8.0, (1, 2, 3, 8))
    o["q"], o["q_descale"] = quantise(q, formats[0], granularities[0], K=1, rng=rng)
    o["k"], o["k_descale"] = quantise(
        k[None, None], formats[1], granularities[1], block_size=L, rng=rng
    )
    return o
