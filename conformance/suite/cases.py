"""Load the framework-neutral fixtures: the manifest, its checksums and the case arrays."""

from __future__ import annotations

import hashlib
import io
import json
from dataclasses import dataclass, field
from functools import cache, cached_property
from pathlib import Path

import numpy as np
import pytest

from conformance import fixtures as fixtures_package
from conformance.backends import numpy_dtype
from conformance.suite.requirements import requires, uses_dtype
from conformance.suite.tolerance import finite_error

FIXTURES = Path(fixtures_package.__file__).resolve().parent


class CorruptFixture(RuntimeError):
    """A fixture file's sha256 does not match the manifest."""


def verify(path: Path, sha256: str) -> bytes:
    data = path.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    if digest != sha256:
        raise CorruptFixture(
            f"{path} has sha256 {digest}, the manifest says {sha256}: the file was changed "
            "by hand or corrupted; regenerate with `python -m conformance.fixtures.generate`"
        )
    return data


@cache
def manifest(root: Path = FIXTURES) -> dict:
    return json.loads((root / "manifest.json").read_text())


def worked_example(root: Path = FIXTURES) -> dict:
    entry = manifest(root)["worked_example"]
    return json.loads(verify(root / entry["file"], entry["sha256"]))


@dataclass
class Case:
    """One fixture: inputs in the case's dtype, the oracle's output, the naive error."""

    id: str
    clause: str
    dtype: str
    meta: dict
    arrays: dict = field(repr=False)
    #: The lines that load this case in a reproduction snippet (a case built again inside
    #: a kernel's domain has its own, ``conformance.suite.rebuilt``).
    loader: str = field(default="", repr=False)

    @property
    def requires(self) -> list[str]:
        return case_requires(self.meta)

    @property
    def expected(self) -> np.ndarray:
        return self.arrays["expected"]

    @cached_property
    def naive_error(self) -> float:
        """max |naive - oracle| of the textbook run in the case's dtype (SPEC §7).

        Not stored: the naive run goes through BLAS, whose summation order depends on the
        CPU kernel and the thread count, so it is computed here, on the machine that runs
        the test, from the stored inputs and compared with the stored oracle output.
        """
        from conformance.fixtures import oracle

        dtype = numpy_dtype(self.dtype)
        if self.meta["kind"] == "attention":
            q, k, v = (self._batched(self.arrays[n]) for n in "qkv")
            naive = oracle.naive_same_precision(
                q, k, v, dtype, mask=self.arrays.get("mask"), **self.options()
            )
            expected = self._batched(self.expected)
        else:
            params = {n[6:]: a for n, a in self.arrays.items() if n.startswith("param.")}
            naive = oracle.naive_module_same_precision(
                self.meta["kind"],
                params,
                self.arrays["x"],
                dtype,
                n_heads=self.meta["shape"]["H"],
                is_causal=self.meta["is_causal"],
            )
            expected = self.expected
        return finite_error(naive, expected)

    def _batched(self, x: np.ndarray) -> np.ndarray:
        return x[None] if self.meta.get("unbatched") else x

    def inputs(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        dt = numpy_dtype(self.dtype)
        return tuple(self.arrays[n].astype(dt) for n in "qkv")

    def mask(self) -> np.ndarray | None:
        mask = self.arrays.get("mask")
        if mask is None or mask.dtype == np.bool_:
            return mask
        return mask.astype(numpy_dtype(self.dtype))

    def options(self) -> dict:
        opts = dict(self.meta["options"])
        if opts.get("window") is not None:
            opts["window"] = tuple(opts["window"])
        if "sinks" in self.arrays:
            # An array, stored with the inputs: in the case's dtype like q (SPEC §15.1).
            opts["sinks"] = self.arrays["sinks"].astype(numpy_dtype(self.dtype))
        if "alibi_slopes" in self.arrays:
            # ALiBi's slopes, stored with the inputs: float32, as FlashAttention takes
            # them, for every dtype of q (SPEC §17.1).
            opts["alibi_slopes"] = self.arrays["alibi_slopes"].astype(np.float32)
        return opts

    def params(self) -> dict[str, np.ndarray]:
        dt = numpy_dtype(self.dtype)
        return {n[6:]: a.astype(dt) for n, a in self.arrays.items() if n.startswith("param.")}

    def d_out(self) -> np.ndarray:
        """The upstream gradient of a gradient case (SPEC §12.1), in the case's dtype."""
        return self.arrays["d_out"].astype(numpy_dtype(self.dtype))

    @property
    def expected_grads(self) -> dict[str, np.ndarray]:
        """The oracle's gradients of a gradient case: "dq", "dk", "dv", maybe "dmask" and
        "dsinks", in the order ``attention_vjp`` returns them."""
        names = ("dq", "dk", "dv", "dmask", "dsinks")
        return {n: self.arrays[f"expected.{n}"] for n in names if f"expected.{n}" in self.arrays}

    def grad_naive_error(self, name: str) -> float:
        """The naive backward's max error for gradient ``name`` (SPEC §12.9), computed on
        this machine like ``naive_error``."""
        return self._grad_naive_errors[name]

    @cached_property
    def _grad_naive_errors(self) -> dict[str, float]:
        from conformance.fixtures import oracle

        q, k, v = (self.arrays[n] for n in "qkv")
        naive = oracle.naive_vjp_same_precision(
            q,
            k,
            v,
            self.arrays["d_out"],
            numpy_dtype(self.dtype),
            mask=self.arrays.get("mask"),
            **self.options(),
        )
        return {name: finite_error(naive[name], want) for name, want in self.expected_grads.items()}

    def call_vjp(self, backend) -> str:
        """A snippet that reproduces this gradient case on ``backend``, for failure messages."""
        return self._snippet(
            backend,
            "attention_vjp(*case.inputs(), case.d_out(), mask=case.mask(), **case.options())",
        )

    def call(self, backend) -> str:
        """A snippet that reproduces this case on ``backend``, for failure messages."""
        return self._snippet(
            backend, "attention(*case.inputs(), mask=case.mask(), **case.options())"
        )

    def _snippet(self, backend, call: str) -> str:
        from conformance.suite.replay import load_expression

        loader = self.loader or (
            f"from conformance.suite.cases import load_case\n    case = load_case({self.id!r})"
        )
        return (
            "from conformance import load_backend\n"
            f"    {loader}\n"
            f"    backend = {load_expression(backend)}\n"
            f"    backend.{call}"
        )


def case_requires(entry: dict) -> list[str]:
    """The capabilities a fixture case uses: those its manifest entry lists, and those its
    shape implies (K < H: "gqa", E ≠ D: "value_dim", unbatched inputs: "unbatched")."""
    needs = list(entry.get("requires", []))
    shape = entry["shape"]
    implied = {
        "gqa": "K" in shape and shape["K"] != shape["H"],
        "value_dim": "E" in shape and shape["E"] != shape["D"],
        "unbatched": bool(entry.get("unbatched")),
    }
    return needs + [cap for cap, used in implied.items() if used and cap not in needs]


def case_marks(entry: dict, *clauses: str) -> list:
    """A fixture case's marks as a test parameter: its clause (and ``clauses``), the
    capabilities it uses and its dtype, so the harness skips it where they are undeclared."""
    marks = [pytest.mark.clause(entry["clause"], *clauses), uses_dtype(entry["dtype"])]
    needs = case_requires(entry)
    return marks + [requires(*needs)] if needs else marks


def _load(entry: dict, root: Path) -> Case:
    data = verify(root / entry["file"], entry["sha256"])
    with np.load(io.BytesIO(data), allow_pickle=False) as z:
        arrays = {name: z[name] for name in z.files}
    return Case(entry["id"], entry["clause"], entry["dtype"], entry, arrays)


@cache
def load_case(case_id: str, root: Path = FIXTURES) -> Case:
    for entry in manifest(root)["cases"]:
        if entry["id"] == case_id:
            return _load(entry, root)
    raise KeyError(f"no fixture case {case_id!r} in {root / 'manifest.json'}")


def case_ids(kind: str = "attention", root: Path = FIXTURES) -> list[str]:
    return [e["id"] for e in manifest(root)["cases"] if e["kind"] == kind]


def case_entries(kinds: tuple[str, ...] = ("attention",), root: Path = FIXTURES) -> list[dict]:
    return [e for e in manifest(root)["cases"] if e["kind"] in kinds]
