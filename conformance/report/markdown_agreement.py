"""The report's sections on how the backends agree: with the oracle and with each other
(SPEC §7.3, §12.10), across shard counts (SPEC §14.2), and the pairwise tests per pair.
``markdown.py`` places them in ``report.md``."""

from __future__ import annotations

from conformance.report.agreement import names_in
from conformance.report.collect import OUTCOMES

_AGREEMENT_INTRO = {
    "outputs": (
        "## Cross-framework agreement on the fixtures",
        "Numbers the tests measured as they asserted (SPEC §7): per dtype, each backend's "
        "worst error against the 50-digit oracle over the attention and module fixtures it "
        "ran, as a fraction of SPEC §7's tolerance (1 is where the test fails), with the "
        "fixture that gave it, its absolute error and its error in units of eps scaled by "
        "max(1, |expected|); then each pair of backends on the same random inputs (SPEC "
        "§7.3, float64 and float32), as a fraction of that test's tolerance (twice §7's). "
        "The heatmaps share one colour scale: white 0, dark blue 1, red beyond.",
    ),
    "gradients": (
        "## Gradients: cross-framework agreement on the gradient fixtures (SPEC §12)",
        "The same for the backward pass: the worst of dq, dk, dv and dmask against the "
        "oracle over every `grad-*` fixture of that dtype the backend ran (SPEC §12.9's "
        "tolerance), then each pair on the same random inputs and on the module's "
        "parameter gradients (SPEC §12.10). Only backends declaring `grad` appear.",
    ),
}


#: The dtypes the pairwise tests draw (SPEC §7.3, §12.10).
PAIRWISE_DTYPES = ("float64", "float32")


def no_pairs_line(dtype: str, quantity: str, backends: int = 2) -> str:
    """Why a dtype's heatmap is one row (or, for one backend, why there is none): no two
    backends were compared in it."""
    what, clause = ("", "§7.3") if quantity == "outputs" else ("' gradients", "§12.10")
    if dtype in PAIRWISE_DTYPES:
        why = "no pairwise test ran here (each needs two backends that declare what it uses)"
    else:
        why = f"the pairwise tests (SPEC {clause}) draw only float64 and float32 ones"
    if backends < 2:
        return (
            f"No two backends{what} were compared on {dtype} inputs: {why}. The table is the "
            "whole comparison (a heatmap of one cell would show nothing more)."
        )
    return (
        f"No two backends{what} were compared on {dtype} inputs: {why}. The heatmap is one "
        "row, each backend against the oracle."
    )


def render_shard_counts(by_backend: dict[str, dict]) -> list[str]:
    if not by_backend:
        return []
    lines = [
        "## Shard-count invariance (SPEC §14.2)",
        "",
        "Each sharded backend's output at P devices against its own output at P = 1, on the "
        "same inputs: the worst over the variants and dtypes tested, as a fraction of the "
        "test's tolerance (twice §7's, whatever P: it does not widen with P), with the "
        "variant that gave it.",
        "",
        "| backend | P | worst difference from P = 1 | in eps | fraction of tolerance | comparisons |",
        "|---|---|---|---|---|---|",
    ]
    for backend, by_p in by_backend.items():
        for P, s in by_p.items():
            lines.append(
                f"| {backend} | {P} | {s['error']:.3g} (`{s['case']}`) | {s['error_eps']:.3g} | "
                f"{s['fraction_of_tolerance']:.3g} | {s['comparisons']} |"
            )
    lines.append("")
    return lines


def _at(s: dict) -> str:
    return f"`{s['case']}`" + (f" {s['quantity']}" if s["quantity"] != "out" else "")


def render_agreement(by_dtype: dict[str, dict], pictures: dict, quantity: str) -> list[str]:
    if not by_dtype:
        return []
    title, intro = _AGREEMENT_INTRO[quantity]
    lines = [title, "", intro, ""]
    prefix = "agreement" if quantity == "outputs" else "gradient-agreement"
    for dtype, block in by_dtype.items():
        heading = dtype if quantity == "outputs" else f"{dtype} gradients"
        lines += [f"### {heading}", ""]
        if block["vs_oracle"]:
            lines += [
                "| backend | compared | worst: error / tolerance | at fixture | abs error | error / eps |",
                "|---|---|---|---|---|---|",
            ]
            for b, s in block["vs_oracle"].items():
                lines.append(
                    f"| {b} | {s['comparisons']} | {_fraction(s)} | {_at(s)} | "
                    f"{s['error']:.3e} | {s['error_eps']:.3g} |"
                )
            lines.append("")
        if block["pairs"]:
            lines += [
                "| pair | compared | worst: difference / tolerance | setup | abs difference |",
                "|---|---|---|---|---|",
            ]
            for pair, s in block["pairs"].items():
                lines.append(
                    f"| {pair} | {s['comparisons']} | {_fraction(s)} | {_at(s)} | {s['error']:.3e} |"
                )
            lines.append("")
        if block["vs_oracle"] and not block["pairs"]:
            lines += [no_pairs_line(dtype, quantity, len(names_in(block))), ""]
        picture = pictures.get(f"{prefix}-{dtype}")
        if picture and len(names_in(block)) >= 1:
            lines += [f"![{heading} agreement heatmap]({picture})", ""]
    return lines


def _fraction(s: dict) -> str:
    x = s["fraction_of_tolerance"]
    text = f"{x:.3g}"
    if x > 1:
        text = f"❌ **{text}** ({s['failed']} of {s['comparisons']} beyond 1)"
    return text


def render_pairs(clauses: dict, backends: list[str]) -> list[str]:
    """The pairwise tests per pair, in the order of the run's backends (first by the pair's
    first backend, then by its second)."""
    order = {name: i for i, name in enumerate(backends)}

    def rank(pair: str) -> tuple:
        return tuple((order.get(name, len(order)), name) for name in pair.split("~"))

    pairs = {b: clauses[b] for b in sorted((b for b in clauses if b and "~" in b), key=rank)}
    if not pairs:
        return []
    lines = [
        "## Every pair on random inputs (SPEC §7.3, §12.10)",
        "",
        "Each pairwise test also counts in both backends' columns of the clause table; "
        "the totals above count it once.",
        "",
        "| pair | passed | failed | skipped |",
        "|---|---|---|---|",
    ]
    for pair, by_clause in pairs.items():
        cell = {o: sum(c[o] for c in by_clause.values()) for o in OUTCOMES}
        lines.append(f"| {pair} | {cell['passed']} | {cell['failed']} | {cell['skipped']} |")
    lines.append("")
    return lines


def render_pipeline_costs(by_backend: dict[str, dict]) -> list[str]:
    """SPEC §20.6 per quantized backend: its error against its declared P pipeline's bound,
    and what that pipeline costs, its bound against the other pipelines' on the same cases."""
    if not by_backend:
        return []
    lines = [
        "## Quantized attention: what the declared P pipeline costs (SPEC §20.6)",
        "",
        "Each quantized test's bound is twice the error of the backend's declared P pipeline, "
        "run plainly on the test's own operands against the oracle, plus float32's floor. The "
        "tests computed the bound of every pipeline on the same operands: *costs* is the "
        "largest ratio of the declared pipeline's bound to another's over the cases (above 1: "
        "the declared pipeline is held to, and allowed, that much more error), with its case.",
        "",
        "| backend | P pipeline | compared | worst: error / bound | at | costs |",
        "|---|---|---|---|---|---|",
    ]
    for backend, s in by_backend.items():
        w = s["worst"]
        fraction = f"{w['fraction']:.3g}"
        if w["fraction"] > 1:
            fraction = f"❌ **{fraction}** ({s['failed']} of {s['comparisons']} beyond 1)"
        costs = "; ".join(
            f"{c['ratio']:.3g}× {other}'s (`{c['case']}`)" for other, c in s["cost"].items()
        )
        lines.append(
            f"| {backend} | {s['pipeline']} | {s['comparisons']} | {fraction} | "
            f"`{w['case']}` | {costs} |"
        )
    lines.append("")
    for backend, s in by_backend.items():
        pipelines = list(s["cases"][0]["bounds"])
        others = [p for p in pipelines if p != s["pipeline"]]
        lines += [
            f"### {backend}: the bound per case under each P pipeline ({s['pipeline']} declared)",
            "",
            "| case | error | "
            + " | ".join(pipelines)
            + " | "
            + " | ".join(f"÷ {p}'s" for p in others)
            + " |",
            "|---|---|" + "---|" * (len(pipelines) + len(others)),
        ]
        for c in s["cases"]:
            b = c["bounds"]
            cells = [f"**{b[p]:.3g}**" if p == s["pipeline"] else f"{b[p]:.3g}" for p in pipelines]
            cells += [f"{b[s['pipeline']] / b[p]:.3g}" if b[p] > 0 else "—" for p in others]
            lines.append(f"| `{c['case']}` | {c['error']:.3g} | " + " | ".join(cells) + " |")
        lines.append("")
    return lines
