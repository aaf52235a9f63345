"""The backend interface: what the suite tests, NumPy in and out.

A backend takes NumPy arrays, converts them to its framework (``from_numpy``), calls the
implementation and converts the result back (``to_numpy``). It declares the optional
capabilities it supports and the dtypes it accepts; the suite decides what to run from
those declarations, never from a backend's name.
"""

from __future__ import annotations

import platform
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

import numpy as np

from conformance.backends.merge import MergeEntryPoints
from conformance.backends.paged import PagedEntryPoints
from conformance.impls import contract
from conformance.vocabulary import QuantizedForm, option_is_set


class BackendUnavailable(LookupError):
    """A backend was asked for that is unknown or cannot be imported."""


def _check_per_head(check: Callable[..., object], values: Any, q: Any) -> None:
    """``check(values, q)`` for a per-head option (sinks, ALiBi's slopes), as NumPy; a q of
    a rank other than 3 or 4 is left to the impl, which refuses it as ever."""
    values, q = np.asarray(values), np.asarray(q)
    if q.ndim in (3, 4):
        check(values, q)


class Backend(PagedEntryPoints, MergeEntryPoints):
    """The interface the suite tests. Subclass it to plug in your own implementation.

    Attributes:
      name: the id used in test ids and the report.
      framework: the library the implementation runs on, for the versions table.
      capabilities: a subset of ``CAPABILITIES``.
      dtypes: a subset of ``DTYPES``.
      options: the options it was loaded with (``load_backend(name, **options)``), so a
        replay can load it the same way.
      conformance_options: the options the conformance run loads it with, when the
        suite's small inputs need another configuration than the fast default to reach
        every code path (SPEC §10.4). Users get the defaults.
    """

    name: str = ""
    framework: str = "numpy"
    capabilities: frozenset[str] = frozenset()
    dtypes: tuple[str, ...] = ("float64", "float32")
    options: Mapping[str, Any] = MappingProxyType({})
    conformance_options: Mapping[str, Any] = MappingProxyType({})
    #: With the capability "quantized": the formats, granularities, P pipeline and output
    #: formats of ``attention_quantized`` (SPEC §20.7).
    quantized: QuantizedForm | None = None
    #: The SPEC sections whose tests this backend runs, when it implements only those (the
    #: quantized backends run §20 alone); empty: every section.
    sections: tuple[str, ...] = ()

    def from_numpy(self, x: np.ndarray) -> Any:
        return x

    def to_numpy(self, x: Any) -> np.ndarray:
        return np.asarray(x)

    def attention(
        self,
        q: np.ndarray,
        k: np.ndarray,
        v: np.ndarray,
        *,
        mask: np.ndarray | None = None,
        is_causal: bool = False,
        scale: float | None = None,
        causal_alignment: str = "top_left",
        window: tuple[int | None, int | None] | None = None,
        softcap: float | None = None,
        dropout_p: float = 0.0,
        seed: int | None = None,
        sinks: np.ndarray | None = None,
        chunk_size: int | None = None,
        alibi_slopes: np.ndarray | None = None,
        return_lse: bool = False,
    ) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
        """out (B, H, T, E) for q (B, H, T, D), k (B, K, S, D), v (B, K, S, E), NumPy in and
        out; ``sinks`` (H,) is one logit per query head (capability "sinks", SPEC §15);
        ``chunk_size`` the length of a local-attention chunk (capability "chunked", §16);
        ``alibi_slopes`` (H,) or (B, H), ALiBi's slopes (capability "alibi", §17). With
        ``return_lse`` (capability "lse", SPEC §21), (out, lse): lse (B, H, T), the
        natural log-sum-exp of each row's scores."""
        options = {"is_causal": is_causal, "scale": scale}
        for key, value in (
            ("causal_alignment", causal_alignment),
            ("window", window),
            ("softcap", softcap),
            ("dropout_p", dropout_p),
        ):
            # An option left at its default is not passed on, so an implementation
            # without that feature needs no parameter for it.
            if option_is_set(key, value):
                options[key] = value
        if dropout_p:
            options["seed"] = seed
        if sinks is not None:
            options["sinks"] = self._sinks(sinks, q)
        if chunk_size is not None:
            options["chunk_size"] = self._chunk_size(chunk_size)
        if alibi_slopes is not None:
            options["alibi_slopes"] = self._alibi_slopes(alibi_slopes, q)
        if return_lse:
            self._refuse_unless_declared("lse", "return_lse", "§21", lambda: None)
            options["return_lse"] = True
        mask = None if mask is None else self.from_numpy(np.asarray(mask))
        out = self._attention(
            self.from_numpy(q), self.from_numpy(k), self.from_numpy(v), mask=mask, **options
        )
        if return_lse:
            return self.to_numpy(out[0]), self.to_numpy(out[1])
        return self.to_numpy(out)

    def _attention(self, q, k, v, **options):
        raise NotImplementedError

    def attention_quantized(
        self,
        q: np.ndarray,
        k: np.ndarray,
        v: np.ndarray,
        *,
        q_descale: np.ndarray,
        k_descale: np.ndarray,
        v_descale: np.ndarray,
        block_size: int | None = None,
        out_descale: np.ndarray | None = None,
        out_format: str | None = None,
        **options: Any,
    ) -> np.ndarray:
        """Attention on quantized operands (capability "quantized", SPEC §20), NumPy in and
        out: q, k, v codes (``ml_dtypes`` float8 arrays or int8) shaped as for
        ``attention``, float32 descales of SPEC §20.2's shapes; out (B, H, T, E) float32,
        or codes in ``out_format`` with ``out_descale``. ``options`` as for ``attention``
        (no dropout)."""
        if "quantized" not in self.capabilities:
            raise NotImplementedError(
                f"attention_quantized is not supported: {self.name} does not declare the "
                "'quantized' capability (SPEC §20)"
            )
        options = {
            key: value
            for key, value in options.items()
            if (value is not None if key == "mask" else option_is_set(key, value))
        }
        if out_descale is not None:
            options.update(out_descale=out_descale, out_format=out_format)
        out = self._attention_quantized(
            q, k, v, q_descale=q_descale, k_descale=k_descale, v_descale=v_descale,
            block_size=block_size, **options,
        )  # fmt: skip
        return self.to_numpy(out)

    def _attention_quantized(self, q, k, v, **options):
        raise NotImplementedError(f"{self.name} does not declare the 'quantized' capability")

    def _sinks(self, sinks: Any, q: Any) -> Any:
        """The sink logits in the backend's framework; refused by name (SPEC §8.5) where
        "sinks" is not declared, once they pass the checks every backend makes (§15.1)."""
        self._refuse_unless_declared(
            "sinks", "sinks", "§15", lambda: _check_per_head(contract.check_sinks, sinks, q)
        )
        return self.from_numpy(np.asarray(sinks))

    def _alibi_slopes(self, slopes: Any, q: Any) -> Any:
        """ALiBi's slopes in the backend's framework; refused by name (SPEC §8.5) where
        "alibi" is not declared, once they pass the checks every backend makes (§17.1)."""
        self._refuse_unless_declared(
            "alibi",
            "alibi_slopes",
            "§17",
            lambda: _check_per_head(contract.check_alibi_slopes, slopes, q),
        )
        return self.from_numpy(np.asarray(slopes))

    def _chunk_size(self, chunk_size: Any) -> Any:
        """The chunk length as given; refused by name (SPEC §8.5) where "chunked" is not
        declared, once it passes the check every backend makes (§16.1)."""
        self._refuse_unless_declared(
            "chunked", "chunk_size", "§16", lambda: contract.check_chunk_size(chunk_size)
        )
        return chunk_size

    def _refuse_unless_declared(
        self, capability: str, what: str, section: str, check: Callable[[], object]
    ) -> None:
        """Where ``capability`` is not declared: ``check()``, the checks every backend
        makes on the call (so bad input gets its usual error first), then
        ``NotImplementedError`` naming ``what`` (SPEC §8.5)."""
        if capability in self.capabilities:
            return
        check()
        raise NotImplementedError(
            f"{what} is not supported: {self.name} does not declare the '{capability}' "
            f"capability (SPEC {section})"
        )

    def prepare(
        self, q: np.ndarray, k: np.ndarray, v: np.ndarray, **options: Any
    ) -> Callable[[], Any]:
        """Convert q, k, v once; return a zero-argument call that runs attention and waits.

        For timing (the benchmark): the conversion from NumPy stays outside the call, and
        the call returns only once the result exists (JAX dispatches asynchronously, so
        an output with ``block_until_ready`` is waited on). ``options`` go to the
        implementation as given; the result stays in the backend's framework.
        """
        q, k, v = (self.from_numpy(x) for x in (q, k, v))

        def call() -> Any:
            out = self._attention(q, k, v, **options)
            wait = getattr(out, "block_until_ready", None)
            return out if wait is None else wait()

        return call

    def attention_vjp(
        self,
        q: np.ndarray,
        k: np.ndarray,
        v: np.ndarray,
        d_out: np.ndarray,
        *,
        mask: np.ndarray | None = None,
        is_causal: bool = False,
        scale: float | None = None,
        causal_alignment: str = "top_left",
        window: tuple[int | None, int | None] | None = None,
        softcap: float | None = None,
        sinks: np.ndarray | None = None,
        chunk_size: int | None = None,
        alibi_slopes: np.ndarray | None = None,
        d_lse: np.ndarray | None = None,
    ) -> tuple[np.ndarray, ...]:
        """The backward pass (capability "grad"), NumPy in and out.

        For the loss L = Σ d_out · attention(q, k, v, ...), with d_out (B, H, T, E) like the
        output: (dq, dk, dv) = (∂L/∂q, ∂L/∂k, ∂L/∂v), shaped and typed like q, k, v; with a
        floating mask and capability "grad_mask", (dq, dk, dv, dmask), dmask shaped like
        the mask; with ``sinks`` (capability "sinks"), dsinks (H,) last (SPEC §15.5).
        ``chunk_size`` (capability "chunked") and ``alibi_slopes`` (capability "alibi") add
        no gradient (SPEC §16.3, §17.3). Options as for ``attention``; there is no dropout in the backward.
        ``d_lse`` (B, H, T) (capability "grad_lse", SPEC §21.7), in the lse's dtype (§21.4),
        is the cotangent of the log-sum-exp: the gradients are then those of
        L = Σ d_out · out + Σ d_lse · lse.
        """
        options = {"is_causal": is_causal, "scale": scale}
        for key, value in (
            ("causal_alignment", causal_alignment),
            ("window", window),
            ("softcap", softcap),
        ):
            if option_is_set(key, value):
                options[key] = value
        if sinks is not None:
            options["sinks"] = self._sinks(sinks, q)
        if chunk_size is not None:
            options["chunk_size"] = self._chunk_size(chunk_size)
        if alibi_slopes is not None:
            options["alibi_slopes"] = self._alibi_slopes(alibi_slopes, q)
        if d_lse is not None:
            self._refuse_unless_declared("grad_lse", "d_lse", "§21.7", lambda: None)
            options["d_lse"] = self.from_numpy(np.asarray(d_lse))
        mask = None if mask is None else self.from_numpy(np.asarray(mask))
        grads = self._attention_vjp(
            self.from_numpy(q),
            self.from_numpy(k),
            self.from_numpy(v),
            self.from_numpy(d_out),
            mask=mask,
            **options,
        )
        # Autograd may hand back transposed views; the caller gets plain C-ordered arrays.
        return tuple(np.ascontiguousarray(self.to_numpy(g)) for g in grads)

    def _attention_vjp(self, q, k, v, d_out, **options):
        raise NotImplementedError(f"{self.name} does not declare the 'grad' capability")

    def prepare_vjp(
        self, q: np.ndarray, k: np.ndarray, v: np.ndarray, d_out: np.ndarray, **options: Any
    ) -> Callable[[], Any]:
        """``prepare`` for the backward pass: q, k, v and d_out converted once; the call
        runs ``attention_vjp`` (forward and backward) and returns once every gradient
        exists, in the backend's framework. ``options`` go to the implementation as given."""
        q, k, v, d_out = (self.from_numpy(x) for x in (q, k, v, d_out))

        def call() -> Any:
            grads = self._attention_vjp(q, k, v, d_out, **options)
            return [
                g if not hasattr(g, "block_until_ready") else g.block_until_ready() for g in grads
            ]

        return call

    def attention_packed(
        self,
        q: np.ndarray,
        k: np.ndarray,
        v: np.ndarray,
        cu_seqlens_q: np.ndarray,
        cu_seqlens_k: np.ndarray,
        *,
        is_causal: bool = False,
        scale: float | None = None,
        causal_alignment: str = "top_left",
        window: tuple[int | None, int | None] | None = None,
        softcap: float | None = None,
    ) -> np.ndarray:
        """Packed variable-length sequences (capability "packed", SPEC §18), NumPy in and
        out: out (H, T, E) for q (H, T, D), k (K, S, D), v (K, S, E) holding N documents one
        after another, document n being queries cu_seqlens_q[n]:cu_seqlens_q[n + 1] and
        keys cu_seqlens_k[n]:cu_seqlens_k[n + 1]; each document's rows are ``attention`` on
        that document alone with the same options."""
        options = self._packed_options(
            is_causal=is_causal,
            scale=scale,
            causal_alignment=causal_alignment,
            window=window,
            softcap=softcap,
        )
        args = self._packed_args(q, k, v, cu_seqlens_q, cu_seqlens_k, options)
        return self.to_numpy(self._attention_packed(*args, **options))

    def attention_packed_vjp(
        self,
        q: np.ndarray,
        k: np.ndarray,
        v: np.ndarray,
        cu_seqlens_q: np.ndarray,
        cu_seqlens_k: np.ndarray,
        d_out: np.ndarray,
        *,
        is_causal: bool = False,
        scale: float | None = None,
        causal_alignment: str = "top_left",
        window: tuple[int | None, int | None] | None = None,
        softcap: float | None = None,
    ) -> tuple[np.ndarray, ...]:
        """The backward pass of ``attention_packed`` (capabilities "packed" and "grad",
        SPEC §18.5): (dq, dk, dv) for the loss L = Σ d_out · out, d_out (H, T, E); the
        boundaries get no gradient."""
        options = self._packed_options(
            is_causal=is_causal,
            scale=scale,
            causal_alignment=causal_alignment,
            window=window,
            softcap=softcap,
        )
        args = self._packed_args(q, k, v, cu_seqlens_q, cu_seqlens_k, options)
        if "grad" not in self.capabilities:
            raise NotImplementedError(f"{self.name} does not declare the 'grad' capability")
        grads = self._attention_packed_vjp(*args, self.from_numpy(np.asarray(d_out)), **options)
        return tuple(np.ascontiguousarray(self.to_numpy(g)) for g in grads)

    @staticmethod
    def _packed_options(**given: Any) -> dict[str, Any]:
        options = {"is_causal": given.pop("is_causal"), "scale": given.pop("scale")}
        for key, value in given.items():
            # As in ``attention``: an option left at its default is not passed on.
            if option_is_set(key, value):
                options[key] = value
        return options

    def _packed_args(self, q, k, v, cu_seqlens_q, cu_seqlens_k, options) -> tuple:
        """q, k, v and the boundaries in the backend's framework; refused by name (SPEC
        §8.5) where "packed" is not declared, once they pass the checks every backend
        makes (§18.1)."""
        q, k, v, cu_q, cu_k = (np.asarray(x) for x in (q, k, v, cu_seqlens_q, cu_seqlens_k))
        self._refuse_unless_declared(
            "packed",
            "attention_packed",
            "§18",
            lambda: contract.check_packed(q, k, v, cu_q, cu_k, **options),
        )
        return tuple(self.from_numpy(x) for x in (q, k, v, cu_q, cu_k))

    def _attention_packed(self, q, k, v, cu_seqlens_q, cu_seqlens_k, **options):
        raise NotImplementedError(f"{self.name} does not declare the 'packed' capability")

    def _attention_packed_vjp(self, q, k, v, cu_seqlens_q, cu_seqlens_k, d_out, **options):
        raise NotImplementedError(f"{self.name} does not declare the 'grad' capability")

    def module_param_grads(
        self,
        kind: str,
        params: dict[str, np.ndarray],
        x: np.ndarray,
        d_out: np.ndarray,
        *,
        n_heads: int,
        is_causal: bool = False,
    ) -> dict[str, np.ndarray]:
        """Gradients of L = Σ d_out · module(x) (capability "module_grad").

        ``kind`` is "mha" (``multi_head_attention``) or "gpt_block" (``is_causal`` is then
        ignored: the block is causal). Returns {parameter name: ∂L/∂parameter} for every
        entry of ``params``, and "x": ∂L/∂x, all NumPy arrays.
        """
        raise NotImplementedError(f"{self.name} does not declare the 'module_grad' capability")

    def multi_head_attention(
        self,
        params: dict[str, np.ndarray],
        x: np.ndarray,
        *,
        n_heads: int,
        mask: np.ndarray | None = None,
        is_causal: bool = False,
    ) -> np.ndarray:
        """The seeds' multi-head layer from a PyTorch-layout ``state_dict`` (capability "module")."""
        raise NotImplementedError(f"{self.name} does not declare the 'module' capability")

    def gpt_block(
        self, params: dict[str, np.ndarray], x: np.ndarray, *, n_heads: int
    ) -> np.ndarray:
        """The seeds' pre-LN GPT block from a PyTorch-layout ``state_dict`` (capability "module")."""
        raise NotImplementedError(f"{self.name} does not declare the 'module' capability")

    def versions(self) -> dict[str, str]:
        """Versions of the libraries this backend runs on, for the report."""
        return {"python": platform.python_version(), "numpy": np.__version__}

    def release(self) -> None:
        """Drop what the backend keeps from earlier calls (compiled programs, say); the
        next call builds it again. The conformance run calls this on every loaded backend
        after each test module. By default nothing is dropped."""

    def __repr__(self) -> str:
        return f"<backend {self.name}: {', '.join(self.dtypes)}; {', '.join(sorted(self.capabilities))}>"
