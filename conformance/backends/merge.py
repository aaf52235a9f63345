"""A backend's merge of partial states (SPEC §22): ``merge_states``, NumPy in and out,
refused by name where a backend does not declare "merge". A part of ``Backend``
(``base.py``), kept on a page of its own."""

from __future__ import annotations

from typing import Any

import numpy as np

from conformance.impls import contract


class MergeEntryPoints:
    """``Backend``'s merge call; it uses its conversions and its refusal by name."""

    def merge_states(
        self, o_a: np.ndarray, lse_a: np.ndarray, o_b: np.ndarray, lse_b: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """Attention over the union of two disjoint key sets from each set's partial state
        (capability "merge", SPEC §22): o (B, H, T, E) in o_a's dtype and lse (B, H, T),
        the natural log-sum-exp, in lse_a's dtype (-inf for a row with no key). NumPy in
        and out."""
        arrays = tuple(np.asarray(x) for x in (o_a, lse_a, o_b, lse_b))
        self._refuse_unless_declared(
            "merge", "merge_states", "§22", lambda: contract.check_merge(*arrays)
        )
        o, lse = self._merge_states(*(self.from_numpy(x) for x in arrays))
        return self.to_numpy(o), self.to_numpy(lse)

    #: How a function's own conventions move the lse it is handed and returns (SPEC §22.12):
    #: ``conversion(magnitude, dtype) -> (a, b)``, or None where the backend takes the
    #: spec's natural lse as it is.
    merge_conversion = None

    def _merge_states(self, o_a: Any, lse_a: Any, o_b: Any, lse_b: Any) -> tuple[Any, Any]:
        raise NotImplementedError(f"{self.name} does not declare the 'merge' capability")
