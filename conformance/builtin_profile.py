"""The frameworks' own attention functions, as they are, on the spec's edge cases.

    python -m conformance.builtin_profile          # prints the table

``torch.nn.functional.scaled_dot_product_attention`` and ``jax.nn.dot_product_attention``
are called directly, with no adapter, and so is a plain textbook attention whose mask
fills blocked scores with -inf before a softmax (nanoGPT's way). Each runs the fixtures
that expose where frameworks disagree: fully masked rows, causal masks with T ≠ S, causal
plus a mask, grouped-query attention, integer masks, sliding windows, softcapping, and
every dtype (including float16 scores that overflow). Each result says what the function
returned and whether that is what the spec requires: in detail (``observed``) and as a
short label that does not depend on rounding (``summary``), from which
``conformance/frameworks.py`` writes the README's table of how the frameworks differ.
An option the function has no parameter for (a window, a softcap) is looked up in the
installed function's own signature and reported as missing, with that signature.

This is information for the report, not a test: a deviation here fails nothing. (The
``torch-sdpa`` backend is the adapter that makes SDPA conform.)
"""

from __future__ import annotations

import importlib.util
import inspect
import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from conformance.backends import numpy_dtype
from conformance.cases import Case, load_case
from conformance.fixtures.oracle import naive_same_precision
from conformance.tolerance import EPS, tolerance

# --- The functions, called as their users call them --------------------------------------


class NoOption(Exception):
    """The function has no parameter for one of the spec's options (a window, a softcap)."""


def parameters(func: Callable) -> list[str]:
    """The parameter names of the installed ``func``: from its signature, or, for a builtin
    without one (``torch.nn.functional.scaled_dot_product_attention``), from the call
    written on the first line of its docstring."""
    try:
        return list(inspect.signature(func).parameters)
    except (TypeError, ValueError):
        head = (func.__doc__ or "").split(")")[0]
        names = head.partition("(")[2].replace("\n", " ").split(",")
        return [re.split(r"[=:\s]", n.strip().lstrip("*"))[0] for n in names if n.strip()]


def _options(func_name: str, names: list[str], known: dict[str, str], given: dict) -> dict:
    """The framework's keyword arguments for the spec's ``given`` options (window,
    softcap), through ``known`` (spec option -> the framework's parameter, used only if
    the installed function has it); NoOption for one it has no parameter for."""
    found = {}
    for option, value in given.items():
        if value is None:
            continue
        if known.get(option) not in names:
            raise NoOption(f"no {option} parameter; {func_name}({', '.join(names)})")
        found[known[option]] = value
    return found


def masked_softmax_attention(q, k, v, *, mask=None, is_causal=False, scale=None):
    """The textbook: scores, -inf where blocked, softmax, weighted sum, all in q's dtype.

    A bool or integer mask blocks where it is 0 (``masked_fill(mask == 0, -inf)``); a
    float mask is added. The softmax subtracts the row maximum (as torch.softmax does), so
    large scores are fine in float32; a fully blocked row is exp(-inf - -inf) = NaN.
    """
    B, H, T, D = q.shape
    S = k.shape[2]
    scale = 1 / np.sqrt(D) if scale is None else scale
    with np.errstate(invalid="ignore", over="ignore"):
        scores = (q @ np.swapaxes(k, -1, -2)) * q.dtype.type(scale)  # (B, H, T, S)
        if mask is not None and mask.dtype.kind in "biu":
            scores = np.where(mask != 0, scores, -np.inf).astype(q.dtype)
        elif mask is not None:
            scores = scores + mask
        if is_causal:
            causal = np.tril(np.ones((T, S), dtype=bool))  # (T, S), top-left
            scores = np.where(causal, scores, -np.inf).astype(q.dtype)
        p = np.exp(scores - scores.max(axis=-1, keepdims=True))  # (B, H, T, S)
        weights = p / p.sum(axis=-1, keepdims=True)  # (B, H, T, S)
        return (weights @ v).astype(q.dtype)  # (B, H, T, E)


def _torch_sdpa() -> Callable:
    import torch

    def from_numpy(x):
        if x.dtype.name == "bfloat16":
            return torch.from_numpy(np.ascontiguousarray(x).view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(np.array(x))

    def to_numpy(x):
        if x.dtype == torch.bfloat16:
            return x.view(torch.int16).numpy().view(numpy_dtype("bfloat16"))
        return x.numpy()

    sdpa = torch.nn.functional.scaled_dot_product_attention
    names = parameters(sdpa)
    # Bottom-right causal alignment is no parameter of SDPA but a mask object, in the
    # installed torch if it has torch.nn.attention.bias.causal_lower_right.
    bias = importlib.import_module("torch.nn.attention.bias")
    lower_right = getattr(bias, "causal_lower_right", None)

    def call(q, k, v, *, mask=None, is_causal=False, scale=None, causal_alignment=None, **option):
        extra = _options("scaled_dot_product_attention", names, {}, option)
        # enable_gqa is SDPA's switch for K < H; without it K must equal H.
        gqa = {"enable_gqa": True} if k.shape[1] != q.shape[1] else {}
        attn_mask = None if mask is None else from_numpy(mask)
        if causal_alignment == "bottom_right":
            if lower_right is None or mask is not None or not is_causal:
                raise NoOption("no causal_lower_right in torch.nn.attention.bias")
            with warnings.catch_warnings():
                # It warns of NaN rows when T > S; the measurement shows what it returns.
                warnings.simplefilter("ignore", UserWarning)
                attn_mask, is_causal = lower_right(q.shape[-2], k.shape[-2]), False
        out = torch.nn.functional.scaled_dot_product_attention(
            from_numpy(q),
            from_numpy(k),
            from_numpy(v),
            attn_mask=attn_mask,
            is_causal=is_causal,
            scale=scale,
            **gqa,
            **extra,
        )
        return to_numpy(out)

    call.version = f"torch {torch.__version__}"
    call.spelled = {"causal_alignment": "`attn_mask=causal_lower_right(T, S)`"}
    return call


def _jax_dot_product_attention() -> Callable:
    import jax

    # float64 inputs need x64; the jax backend sets the same flag.
    jax.config.update("jax_enable_x64", True)

    names = parameters(jax.nn.dot_product_attention)
    # The spec's window (left, right) is JAX's local_window_size (left, right).
    known = {"window": "local_window_size"}

    def call(q, k, v, *, mask=None, is_causal=False, scale=None, **option):
        # JAX is sequence-first: (B, T, N, H) with N heads and H the head dim.
        to_btnh = lambda x: jax.numpy.asarray(np.swapaxes(x, 1, 2))  # noqa: E731
        extra = _options("dot_product_attention", names, known, option)
        # `mask` takes booleans (integers are refused there), `bias` is added.
        if mask is not None and mask.dtype.kind in "biu":
            extra["mask"] = jax.numpy.asarray(
                np.broadcast_to(mask, (1,) * (4 - mask.ndim) + mask.shape)
            )
        elif mask is not None:
            extra["bias"] = jax.numpy.asarray(
                np.broadcast_to(mask, (1,) * (4 - mask.ndim) + mask.shape)
            )
        out = jax.nn.dot_product_attention(
            to_btnh(q), to_btnh(k), to_btnh(v), scale=scale, is_causal=is_causal, **extra
        )
        return np.swapaxes(np.asarray(out), 1, 2)

    call.version = f"jax {jax.__version__}"
    call.spelled = {"window": "`local_window_size`"}
    return call


def functions() -> dict[str, Callable]:
    """The functions to profile: those whose framework is installed, and the textbook."""
    found: dict[str, Callable] = {}
    if importlib.util.find_spec("torch") is not None:
        found["torch SDPA"] = _torch_sdpa()
    if importlib.util.find_spec("jax") is not None:
        found["jax.nn.dot_product_attention"] = _jax_dot_product_attention()

    def textbook(q, k, v, *, mask=None, is_causal=False, scale=None, **option):
        _options("masked_softmax_attention", parameters(masked_softmax_attention), {}, option)
        return masked_softmax_attention(q, k, v, mask=mask, is_causal=is_causal, scale=scale)

    textbook.version = f"numpy {np.__version__}"
    found["-inf masked softmax"] = textbook
    return found


# --- The edge cases ------------------------------------------------------------------------


def _naive(case: Case, **change) -> np.ndarray:
    """The float64 textbook on the case's inputs with some options changed: what a
    function that deviates in that one way would return."""
    q, k, v = (x.astype(np.float64) for x in case.inputs())
    options = {"mask": case.mask(), **case.options(), **change}
    if options["mask"] is not None and options["mask"].dtype != np.bool_:
        options["mask"] = options["mask"].astype(np.float64)
    return naive_same_precision(q, k, v, np.float64, **options)


def _mean_of_v_rows(case: Case) -> np.ndarray:
    expected = case.expected.copy()
    empty = np.all(expected == 0, axis=-1)  # (B, H, T): the rows the spec sends to 0
    v = case.inputs()[2].astype(np.float64)
    G = expected.shape[1] // v.shape[1]
    mean = np.repeat(v.mean(axis=-2), G, axis=0 if v.ndim == 3 else 1)  # (B, H, E)
    return np.where(empty[..., None], mean[..., None, :], expected)


def _tiled_heads(case: Case) -> np.ndarray:
    q, k, v = (x.astype(np.float64) for x in case.inputs())
    G = q.shape[1] // k.shape[1]
    k, v = np.tile(k, (1, G, 1, 1)), np.tile(v, (1, G, 1, 1))
    return naive_same_precision(q, k, v, np.float64, **case.options())


def _int_mask_as_bool(case: Case) -> np.ndarray:
    return _naive(case, mask=np.asarray(case.mask(), dtype=np.float64) > -np.inf)


def _int_mask_added(case: Case) -> np.ndarray:
    return _naive(case, mask=(np.asarray(case.mask(), dtype=np.float64) > -np.inf) * 1.0)


@dataclass
class EdgeCase:
    """One question the frameworks answer differently, asked with one fixture.

    ``precision`` cases are judged by SPEC §7's tolerance and the output dtype. The others
    ask what is computed, not how precisely: a result within 1e-5 · max(1, |expected|)
    counts (JAX computes the softmax in float32 even for float64 input, which the float64
    row shows), and, except in the fully-masked-rows cases, only rows with a key to
    attend are compared, so that one deviation does not hide another.
    """

    title: str
    fixture: str
    spec: str
    #: What a deviating function returns instead: label -> function of the case.
    alternatives: dict[str, Callable[[Case], np.ndarray]] = field(default_factory=dict)
    precision: bool = False
    empty_rows: bool = False
    mask_dtype: str | None = None
    #: What the function is given, in words, when it is not just the fixture's inputs.
    inputs: str = ""
    #: The spec's options the case asks for beyond mask, is_causal and scale (window,
    #: softcap), passed on under the framework's own name where it has one.
    options: tuple[str, ...] = ()
    #: The fixture holds a NaN input: the rows that read it must come back NaN (§4.9).
    nan: bool = False

    def described(self) -> str:
        """What the row tests, for its label: the inputs, and the fixture they come from."""
        return self.inputs or f"the inputs of `{self.fixture}`"


EDGE_CASES = [
    EdgeCase(
        "fully masked rows (bool mask)",
        "fully-masked-rows-float64",
        "0 (§4.3)",
        {"mean of V": _mean_of_v_rows},
        empty_rows=True,
        inputs="`fully-masked-rows-float64`: a bool mask with rows that allow no key",
    ),
    EdgeCase(
        "fully masked rows (float mask, -inf)",
        "float-mask-fully-masked-float64",
        "0 (§4.3)",
        {"mean of V": _mean_of_v_rows},
        empty_rows=True,
        inputs="`float-mask-fully-masked-float64`: a float mask with rows of -inf only",
    ),
    EdgeCase(
        "causal, T=7 < S=13",
        "causal-T7-S13-float64",
        "top-left: s ≤ t (§3.4)",
        {"bottom-right": lambda c: _naive(c, causal_alignment="bottom_right")},
    ),
    EdgeCase(
        "causal, T=13 > S=7",
        "causal-T13-S7-float64",
        "top-left: s ≤ t (§3.4)",
        {"bottom-right": lambda c: _naive(c, causal_alignment="bottom_right")},
    ),
    EdgeCase(
        "causal bottom-right, T=13 > S=7",
        "bottom-right-T13-S7-float64",
        "on request: s ≤ t + S − T (§3.5)",
        {"top-left": lambda c: _naive(c, causal_alignment="top_left")},
        empty_rows=True,
        options=("causal_alignment",),
        inputs="`bottom-right-T13-S7-float64`: causal, aligned bottom-right, so the first 6 "
        "queries see no key",
    ),
    EdgeCase(
        "causal + bool mask",
        "causal-bool-mask-float64",
        "both apply (§3.7)",
        {
            "mask only": lambda c: _naive(c, is_causal=False),
            "causal only": lambda c: _naive(c, mask=None),
        },
    ),
    EdgeCase(
        "GQA, H=6, K=2",
        "gqa-H6-K2-float64",
        "head h uses K/V head h // 3 (§4.6)",
        {"tiled heads (h % K)": _tiled_heads},
    ),
    EdgeCase(
        "integer mask (int64 0/1)",
        "float-mask-float64",
        "TypeError (§3.3)",
        {"treated as bool (0 blocks)": _int_mask_as_bool, "added to the scores": _int_mask_added},
        mask_dtype="int64",
        inputs="the inputs of `float-mask-float64` with an int64 mask instead of its float "
        "mask: 1 where that is finite, 0 where it is -inf",
    ),
    EdgeCase(
        "sliding window (2, 1)",
        "window-2-1-float64",
        "keys t − 2 … t + 1 (§3.6)",
        {"left and right swapped": lambda c: _naive(c, window=(1, 2))},
        options=("window",),
        inputs="`window-2-1-float64`: T = S = 9, window (left 2, right 1), no mask",
    ),
    EdgeCase(
        "softcap 5",
        "softcap-5-float64",
        "5 · tanh(score / 5) before the mask (§4.2)",
        {"no softcap": lambda c: _naive(c, softcap=None)},
        options=("softcap",),
        inputs="`softcap-5-float64`: softcap 5, no mask",
    ),
    EdgeCase(
        "NaN in a query row",
        "nan-q-plain-float32",
        "that row NaN, the others as without it (§4.9)",
        nan=True,
        inputs="`nan-q-plain-float32`: T = S = 5, D = E = 4, no mask, q[0, 1, 2, 3] = NaN",
    ),
    EdgeCase(
        "float64",
        "T7-S7-float64",
        "float64 out, within §7",
        {"float32 precision": lambda c: naive_same_precision(*c.inputs(), np.float32)},
        precision=True,
    ),
    EdgeCase("float32", "T7-S7-float32", "float32 out, within §7", precision=True),
    EdgeCase("float16", "T7-S7-float16", "float16 out, within §7 (§4.5)", precision=True),
    EdgeCase("bfloat16", "T7-S7-bfloat16", "bfloat16 out, within §7 (§4.5)", precision=True),
    EdgeCase(
        "float16, q·k ≈ 9·10⁴ (beyond 65504)",
        "large-logits-f16-scores-overflow-float16",
        "finite, within §7 (§4.5)",
        precision=True,
    ),
]


def _judge(edge: EdgeCase, case: Case, out) -> dict:
    """What ``out`` is, in words, and whether it is what the spec requires.

    {"observed": the details, "summary": a short label that names the behaviour and not
    the rounding (no error sizes, no exception messages), "conforms": bool}.
    """
    if isinstance(out, NoOption):
        return {"observed": f"none: {out}", "summary": "none", "conforms": False}
    if isinstance(out, Exception):
        message = str(out).strip().splitlines()[0] if str(out).strip() else ""
        if len(message) > 70:
            message = message[:70] + "…"
        conforms = edge.mask_dtype is not None and isinstance(out, TypeError)
        name = type(out).__name__
        return {
            "observed": f"raises {name}: {message}",
            "summary": f"raises `{name}`",
            "conforms": conforms,
        }
    notes = []
    dtype_ok = out.dtype == numpy_dtype(case.dtype)
    if not dtype_ok:
        notes.append(f"returns {out.dtype}")
    x = np.asarray(out, dtype=np.float64)
    y = case.expected
    if x.shape != y.shape:
        text = f"shape {x.shape}, expected {y.shape}"
        return {"observed": text, "summary": text, "conforms": False}
    if edge.nan:
        # §4.9: a row that reads a NaN is NaN; a finite row there hides the NaN.
        lost = np.isnan(y).any(axis=-1) & ~np.isnan(x).all(axis=-1)  # (B, H, T)
        if lost.any():
            n = int(lost.sum())
            what = "0" if (x[lost] == 0).all() else "finite"
            text = f"{what} instead of NaN in {n} row{'s' if n != 1 else ''}"
            return {
                "observed": "; ".join([text, *notes]),
                "summary": "; ".join([text, *notes]),
                "conforms": False,
            }
    rows = ~np.isnan(y).any(axis=-1)  # (B, H, T): the rows to compare, NaN rows checked above
    y = np.where(np.isnan(y), 0.0, y)
    if not edge.empty_rows:
        rows &= np.any(y != 0, axis=-1)  # a row the spec sends to 0 has no key to attend
    bad = ~np.isfinite(x) & rows[..., None]
    if bad.any():
        n = int(np.any(bad, axis=-1).sum())
        text = f"NaN/inf in {n} row{'s' if n != 1 else ''}"
        return {
            "observed": "; ".join([text, *notes]),
            "summary": "; ".join([text, *notes]),
            "conforms": False,
        }
    scale = EPS[case.dtype] * max(1.0, float(np.max(np.abs(y), initial=0.0)))
    tol = tolerance(case.dtype, case.naive_error, y)
    loose = max(tol, 1e-5 * max(1.0, float(np.max(np.abs(y), initial=0.0))))
    if not edge.precision:
        tol = loose

    def distance(z: np.ndarray) -> float:
        return float(np.max(np.abs(x - z)[rows], initial=0.0))

    err = distance(y)
    if err <= tol:
        conforms = dtype_ok and edge.mask_dtype is None
        label = "as the spec" if edge.mask_dtype is None else "accepted, as the bool mask"
        summary = "; ".join([label, *notes])
        if err <= tolerance(case.dtype, case.naive_error, y):
            notes.append(f"error {err / scale:.3g} eps")
        else:
            notes.append(f"to {err:.0e} (see the float64 row)")
        return {"observed": "; ".join([label, *notes]), "summary": summary, "conforms": conforms}
    for name, make in edge.alternatives.items():
        if distance(make(case)) <= loose:
            label = name if edge.mask_dtype is None else f"accepted, {name}"
            text = "; ".join([label, *notes])
            return {"observed": text, "summary": text, "conforms": False}
    return {
        "observed": "; ".join(["differs from the spec", *notes, f"error {err / scale:.3g} eps"]),
        "summary": "; ".join(["differs from the spec", *notes]),
        "conforms": False,
    }


def profile() -> dict:
    """Run every function on every edge case: {"functions": {name: version}, "cases": [...]}."""
    funcs = functions()
    rows = []
    for edge in EDGE_CASES:
        case = load_case(edge.fixture)
        q, k, v = case.inputs()
        mask = case.mask()
        if edge.mask_dtype is not None:
            mask = (np.asarray(mask, dtype=np.float64) > -np.inf).astype(edge.mask_dtype)
        options = case.options()
        results = {}
        for name, func in funcs.items():
            try:
                out = func(
                    q,
                    k,
                    v,
                    mask=mask,
                    is_causal=options["is_causal"],
                    scale=options["scale"],
                    **{o: options[o] for o in edge.options},
                )
            except Exception as err:  # the point is to show what happens, whatever it is
                out = err
            results[name] = _judge(edge, case, out)
            spelled = [func.spelled[o] for o in edge.options if o in getattr(func, "spelled", {})]
            if spelled and not isinstance(out, NoOption):
                for key in ("observed", "summary"):
                    results[name][key] += f", with {', '.join(spelled)}"
        rows.append(
            {
                "case": edge.title,
                "fixture": edge.fixture,
                "inputs": edge.described(),
                "spec": edge.spec,
                "results": results,
            }
        )
    return {"functions": {n: f.version for n, f in funcs.items()}, "cases": rows}


def render_markdown(data: dict) -> list[str]:
    names = list(data["functions"])
    lines = [
        "| edge case: what the functions are given | the spec | " + " | ".join(names) + " |",
        "|---|---|" + "---|" * len(names),
    ]
    for row in data["cases"]:
        cells = []
        for name in names:
            r = row["results"][name]
            cells.append(f"{'✅' if r['conforms'] else '❌'} {r['observed']}")
        lines.append(
            f"| **{row['case']}**: {row['inputs']} | {row['spec']} | " + " | ".join(cells) + " |"
        )
    return lines


if __name__ == "__main__":
    print("\n".join(render_markdown(profile())))
