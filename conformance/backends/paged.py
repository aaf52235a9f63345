"""A backend's paged-KV-cache entry points (SPEC §19): ``attention_paged`` and its backward,
NumPy in and out, refused by name where a backend does not declare "paged". A part of
``Backend`` (``base.py``), kept on a page of its own."""

from __future__ import annotations

from typing import Any

import numpy as np

from conformance.impls import contract
from conformance.vocabulary import option_is_set


class PagedEntryPoints:
    """``Backend``'s paged calls; they use its conversions and its refusal by name."""

    def attention_paged(
        self,
        q: np.ndarray,
        k_pages: np.ndarray,
        v_pages: np.ndarray,
        block_table: np.ndarray,
        seq_lens: np.ndarray,
        *,
        is_causal: bool = False,
        scale: float | None = None,
        window: tuple[int | None, int | None] | None = None,
        softcap: float | None = None,
    ) -> np.ndarray:
        """out (B, H, T, E) for q (B, H, T, D) and a paged KV cache (capability "paged",
        SPEC §19): k_pages (N, K, L, D) and v_pages (N, K, L, E), N pages of L slots;
        sequence b's key s lives in page block_table[b, s // L] (block_table (B, M),
        integer), slot s % L, and sequence b has seq_lens[b] keys (seq_lens (B,),
        integer). The queries are each sequence's last T positions: causality and the
        window are counted bottom-right against seq_lens[b]. NumPy in and out."""
        arrays = self._paged_arrays(q, k_pages, v_pages, block_table, seq_lens)
        options = self._paged_options(arrays, is_causal, scale, window, softcap)
        out = self._attention_paged(*(self.from_numpy(x) for x in arrays), **options)
        return self.to_numpy(out)

    def attention_paged_vjp(
        self,
        q: np.ndarray,
        k_pages: np.ndarray,
        v_pages: np.ndarray,
        block_table: np.ndarray,
        seq_lens: np.ndarray,
        d_out: np.ndarray,
        *,
        is_causal: bool = False,
        scale: float | None = None,
        window: tuple[int | None, int | None] | None = None,
        softcap: float | None = None,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The backward pass of ``attention_paged`` (capabilities "paged" and "grad",
        SPEC §19.4): (dq, dk_pages, dv_pages) for L = Σ d_out · attention_paged(...),
        shaped and typed like q, k_pages, v_pages. A slot no sequence reads gets exactly 0;
        a page two sequences share gets the sum of both."""
        arrays = self._paged_arrays(q, k_pages, v_pages, block_table, seq_lens)
        d_out = np.asarray(d_out)
        options = self._paged_options(arrays, is_causal, scale, window, softcap)
        if "grad" not in self.capabilities:
            raise NotImplementedError(f"{self.name} does not declare the 'grad' capability")
        if softcap is not None and "grad_softcap" not in self.capabilities:
            raise NotImplementedError(
                f"softcap in attention_paged_vjp is not supported: {self.name} does not "
                "declare the 'grad_softcap' capability (SPEC §12.2)"
            )
        grads = self._attention_paged_vjp(
            *(self.from_numpy(x) for x in (*arrays, d_out)), **options
        )
        return tuple(np.ascontiguousarray(self.to_numpy(g)) for g in grads)

    @staticmethod
    def _paged_arrays(*arrays: Any) -> tuple[np.ndarray, ...]:
        return tuple(np.asarray(x) for x in arrays)

    def _paged_options(self, arrays, is_causal, scale, window, softcap) -> dict:
        """The options set, as the impl takes them; where "paged" is not declared, a
        refusal by name (SPEC §8.5, §19.6), once the call passes the checks every backend
        makes (§19.5)."""
        checked = {"is_causal": is_causal, "scale": scale, "window": window, "softcap": softcap}
        self._refuse_unless_declared(
            "paged", "attention_paged", "§19", lambda: contract.check_paged(*arrays, **checked)
        )
        options = {"is_causal": is_causal, "scale": scale}
        for key, value in (("window", window), ("softcap", softcap)):
            if option_is_set(key, value):
                options[key] = value
        return options

    def _attention_paged(self, q, k_pages, v_pages, block_table, seq_lens, **options):
        raise NotImplementedError(f"{self.name} does not declare the 'paged' capability")

    def _attention_paged_vjp(self, q, k_pages, v_pages, block_table, seq_lens, d_out, **options):
        raise NotImplementedError(f"{self.name} does not declare the 'paged' capability")
