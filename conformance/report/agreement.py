"""Cross-framework agreement, summarised from the numbers the tests published.

Each measurement (``conformance/suite/measure.py``) is one comparison a test asserted: a backend
against the oracle on a fixture (SPEC §7.1, §12.9), or two backends against each other on
the same random inputs (SPEC §7.3, §12.10), with the max error, the tolerance the test
applied and the unit eps · max(1, |expected|). Per quantity ("outputs", "gradients") and
dtype, this keeps each backend's and each pair's worst comparison, by fraction of the
tolerance (1.0 is where the test fails), and names the fixture or setup that gave it.
"""

from __future__ import annotations

import math

from conformance.backends import DTYPES

#: The quantities the report summarises separately.
QUANTITIES = ("outputs", "gradients")


#: The quantity of a sharded backend's output compared with its own P = 1 output (§14.2).
VS_ONE_SHARD = "vs P=1"


def quantity_of(measurement: dict) -> str:
    if measurement["quantity"] == VS_ONE_SHARD:
        return "shards"
    return "outputs" if measurement["quantity"] == "out" else "gradients"


def _fraction(m: dict) -> float:
    if m["tolerance"] > 0:
        return m["error"] / m["tolerance"]
    return 0.0 if m["error"] == 0 else math.inf


def _worst(measurements: list[dict]) -> dict:
    worst = max(measurements, key=_fraction)
    return {
        "case": worst["case"],
        "quantity": worst["quantity"],
        "error": worst["error"],
        "error_eps": worst["error"] / worst["unit"],
        "tolerance": worst["tolerance"],
        "fraction_of_tolerance": _fraction(worst),
    }


def agreement(measurements: list[dict], backends: list[str]) -> dict[str, dict[str, dict]]:
    """{quantity: {dtype: {"vs_oracle": {backend: summary}, "pairs": {"a~b": summary}}}}

    A summary: "comparisons" (how many), "failed" (how many beyond the tolerance), and the
    worst one: "case", "quantity", "error", "error_eps", "tolerance",
    "fraction_of_tolerance". Backends and pairs keep the order of ``backends``; a dtype
    with nothing measured is left out.
    """
    order = {name: i for i, name in enumerate(backends)}

    def rank(key: str) -> tuple:
        return tuple(order.get(part, len(order)) for part in key.split("~"))

    grouped: dict = {}
    for m in measurements:
        kind = "pairs" if "~" in m["backend"] else "vs_oracle"
        grouped.setdefault(quantity_of(m), {}).setdefault(m["dtype"], {}).setdefault(
            kind, {}
        ).setdefault(m["backend"], []).append(m)
    result: dict = {}
    for quantity in QUANTITIES:
        by_dtype = grouped.get(quantity, {})
        result[quantity] = {}
        for dtype in DTYPES:
            if dtype not in by_dtype:
                continue
            block = {}
            for kind in ("vs_oracle", "pairs"):
                found = by_dtype[dtype].get(kind, {})
                block[kind] = {
                    key: {
                        "comparisons": len(found[key]),
                        "failed": sum(_fraction(m) > 1 for m in found[key]),
                        **_worst(found[key]),
                    }
                    for key in sorted(found, key=rank)
                }
            result[quantity][dtype] = block
    return result


def names_in(block: dict) -> list[str]:
    """The backends a dtype's block mentions, against the oracle or in a pair, in order."""
    names = list(block["vs_oracle"])
    for pair in block["pairs"]:
        for name in pair.split("~"):
            if name not in names:
                names.append(name)
    return names


def shard_counts(measurements: list[dict]) -> dict[str, dict[str, dict]]:
    """{backend: {P: summary}}: each sharded backend's worst output difference from its
    own P = 1 output over the variants and dtypes tested (SPEC §14.2); the case names P
    first ("P=3 causal")."""
    grouped: dict = {}
    for m in measurements:
        if quantity_of(m) == "shards":
            P = m["case"].split()[0].removeprefix("P=")
            grouped.setdefault(m["backend"], {}).setdefault(P, []).append(m)
    return {
        backend: {
            P: {"comparisons": len(found), **_worst(found)}
            for P, found in sorted(by_p.items(), key=lambda item: int(item[0]))
        }
        for backend, by_p in grouped.items()
    }


def pipeline_costs(records: list[dict], backends: list[str]) -> dict[str, dict]:
    """{backend: summary} of the quantized tests' comparisons (SPEC §20.6): each one's error
    and §20.6's bound on its operands under every P pipeline, so that what the declared
    pipeline costs is read off the same cases.

    A summary: "pipeline" (the declared one), "comparisons", "failed" (beyond the declared
    bound), "worst" (the case nearest its bound: "case", "error", "bound", "fraction"),
    "cost" ({other pipeline: {"ratio", "case"}}: the largest ratio of the declared
    pipeline's bound to that pipeline's, over the cases, and the case that gave it) and
    "cases" (each case's "case", "error" and "bounds"). Backends keep the order of
    ``backends``, then the order they came in.
    """
    order = {name: i for i, name in enumerate(backends)}
    grouped: dict[str, list[dict]] = {}
    for r in records:
        grouped.setdefault(r["backend"], []).append(r)
    result = {}
    for name in sorted(grouped, key=lambda n: order.get(n, len(order))):
        found = grouped[name]
        declared = found[0]["pipeline"]

        def fraction(r: dict, declared=declared) -> float:
            b = r["bounds"][declared]
            return r["error"] / b if b > 0 else (0.0 if r["error"] == 0 else math.inf)

        worst = max(found, key=fraction)
        cost = {}
        for other in found[0]["bounds"]:
            if other == declared:
                continue
            ratios = [
                (r["bounds"][declared] / r["bounds"][other], r["case"])
                for r in found
                if r["bounds"][other] > 0
            ]
            if ratios:
                ratio, case = max(ratios)
                cost[other] = {"ratio": ratio, "case": case}
        result[name] = {
            "pipeline": declared,
            "comparisons": len(found),
            "failed": sum(fraction(r) > 1 for r in found),
            "worst": {
                "case": worst["case"],
                "error": worst["error"],
                "bound": worst["bounds"][declared],
                "fraction": fraction(worst),
            },
            "cost": cost,
            "cases": [
                {"case": r["case"], "error": r["error"], "bounds": r["bounds"]} for r in found
            ],
        }
    return result
