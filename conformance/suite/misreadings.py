"""The one registry of misreadings: every known way to misread the spec that
``diagnosis.py`` holds a departing output against (SPEC §13.16), each a ``Misreading``
(``misreading.py``) of data: its name, the sentence that names it, the clauses whose
failures it explains, when it applies to a departing call and how to compute what the
function with it planted returns. They are grouped by area (``AREAS``), one module of
data an area: attention whole (``misreadings_attention.py``), split-KV decoding
(``misreadings_split_kv.py``), the log-sum-exp and merges of partial states
(``misreadings_lse_merge.py``), quantized attention (``misreadings_quantized.py``), the
backward pass (``misreadings_gradients.py``). This
module assembles them: look misreadings up and iterate them here (``AREAS``,
``MISREADINGS``, ``BY_NAME``). A new frontier adds an area's module of data, its entry
in ``AREAS`` and a reader of its calls in ``diagnosis_readers.py``.

Each is computed from the departing call's inputs (``planted.py`` and, an area a module,
``planted_split_kv.py``, ``planted_lse_merge.py``, ``planted_quantized.py``,
``planted_gradients.py``): for
attention, the oracle's float64 textbook run (``naive_same_precision`` in float64, the
fast path; the 50-digit ``attention`` costs milliseconds a row) on the inputs with the
misreading planted in them, or, for what no input can express (a slot that is read
though blocked, a softcap after the mask, a sink in the numerator, splits of the keys), a
float64 textbook on the oracle's scores; for the lse, the textbook lse; for a merge, the
formula on the call's own pieces; for quantized attention, the declared P pipeline
(``conformance.fixtures.quantized.pipeline``) on misread codes or descales; for a
gradient, the textbook backward (``naive_vjp_same_precision`` in float64) on the misread
inputs, by the chain rule where the misreading scales one. The order
within an area is the order in which ``diagnosis.find`` tries them: where two explain a
failure alike, the first names it.
"""

from __future__ import annotations

from conformance.suite.misreading import Misreading, always
from conformance.suite.misreadings_attention import ATTENTION, TILES
from conformance.suite.misreadings_gradients import GRADIENTS
from conformance.suite.misreadings_lse_merge import LSE, MERGE
from conformance.suite.misreadings_quantized import P_TILES, QUANTIZED
from conformance.suite.misreadings_split_kv import BLOCKS, SPLIT_KV, SPLITS

__all__ = [
    "AREAS",
    "ATTENTION",
    "BLOCKS",
    "BY_NAME",
    "GRADIENTS",
    "LSE",
    "MERGE",
    "MISREADINGS",
    "P_TILES",
    "QUANTIZED",
    "SPLITS",
    "SPLIT_KV",
    "TILES",
    "ZEROS",
    "Misreading",
]


#: An output of zeros that no misreading gives: no key's value reaches the output. Tried
#: by ``diagnosis.find`` after every area's misreadings, on an output of exact zeros only.
ZEROS = Misreading(
    "zeros",
    "returns zeros: no key's value reaches the output",
    always,
    lambda c: None,
    alone=True,
)


#: Every misreading by area, in the order the areas' calls are read.
AREAS: dict[str, tuple[Misreading, ...]] = {
    "attention": ATTENTION,
    "split-kv": SPLIT_KV,
    "lse": LSE,
    "merge": MERGE,
    "quantized": QUANTIZED,
    "gradients": GRADIENTS,
}
MISREADINGS: tuple[Misreading, ...] = tuple(m for area in AREAS.values() for m in area)
#: The misreadings by name.
BY_NAME = {m.name: m for m in MISREADINGS}
assert len(BY_NAME) == len(MISREADINGS), "two misreadings share a name"
