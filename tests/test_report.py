"""The main job's report: verdicts, clause table, grouped skips, agreement from the tests'
own measurements, pictures, the frameworks' own functions, in Markdown, JSON and JUnit XML,
from one command."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np
import pytest

from conformance.suite.measure import max_error

ROOT = Path(__file__).resolve().parent.parent


def _report(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "conformance", "report", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )


def _check_agreement(data: dict, md: str) -> None:
    """The agreement tables of a report on numpy and numpy-flash: every dtype's outputs
    and gradients against the oracle, and the pair compared where §7.3 and §12.10 run."""
    outputs = data["agreement"]["outputs"]
    for dtype in ("float64", "float32", "float16", "bfloat16"):
        block = outputs[dtype]
        assert set(block["vs_oracle"]) == {"numpy", "numpy-flash"}
        for s in block["vs_oracle"].values():
            assert 0 < s["fraction_of_tolerance"] <= 1 and s["failed"] == 0
            assert s["case"].endswith(dtype) or s["case"].startswith(("mha", "gpt"))
            assert f"| `{s['case']}` |" in md  # the table names the worst fixture
        # The pairwise tests (SPEC §7.3) run float64 and float32 only; the other dtypes
        # say so, rather than draw pairs never compared.
        compared = dtype in ("float64", "float32")
        assert ("numpy~numpy-flash" in block["pairs"]) == compared
        heading = md.split(f"### {dtype}\n")[1].split("###")[0]
        assert (f"No two backends were compared on {dtype} inputs" in heading) != compared
    gradients = data["agreement"]["gradients"]
    for dtype in ("float64", "float32", "float16", "bfloat16"):
        assert set(gradients[dtype]["vs_oracle"]) == {"numpy", "numpy-flash"}
        # The pairwise gradient tests (SPEC §12.10) run float64 and float32 only.
        assert ("numpy~numpy-flash" in gradients[dtype]["pairs"]) == (
            dtype in ("float64", "float32")
        )
        assert f"### {dtype} gradients" in md
    section = md.index("## Gradients: cross-framework agreement on the gradient fixtures")
    assert md.index("## Cross-framework agreement on the fixtures") < section
    assert section < md.index("## Every pair on random inputs")


@pytest.mark.clause("13.7", "13.8")
def test_report_on_two_backends(tmp_path):
    run = _report(
        "--backend",
        "numpy",
        "--backend",
        "numpy-flash",
        "--workers",
        "2",
        "--out",
        str(tmp_path),
        "-k",
        "test_fixture_case or test_module_fixture or test_gradient_fixture or worked_example "
        "or test_backends_agree or bad_input",
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    data = json.loads((tmp_path / "report.json").read_text())
    md = (tmp_path / "report.md").read_text()
    assert data["backends"] == ["numpy", "numpy-flash"]
    assert data["summary"]["failed"] == 0 and data["summary"]["passed"] > 100
    assert data["versions"]["pytest-xdist"]  # the tests ran in two worker processes
    assert data["machine"] and data["date"]

    # "wrote ... report.md" stands on its own line, after pytest's.
    assert f"wrote {tmp_path / 'report.md'}" in run.stdout.splitlines()

    # The verdict comes first: one line per backend, with what it does not declare.
    assert md.index("## Verdict") < md.index("## Clauses per backend")
    from conformance import load_backend
    from conformance.backends import CAPABILITIES

    for name in ("numpy", "numpy-flash"):
        verdict = data["verdicts"][name]
        assert verdict["conforms"] and not verdict["failed_clauses"] and verdict["ran"] > 50
        lacks = sorted(set(CAPABILITIES) - load_backend(name).capabilities)
        assert verdict["lacks_capabilities"] == lacks
        assert re.search(
            rf"^\| {name} \| ✅ conforms: \d+ tests, none failed \| "
            rf"{', '.join(lacks) or 'nothing: all declared'} \|$",
            md,
            re.M,
        )
    lacks = set(data["verdicts"]["numpy-flash"]["lacks_capabilities"])
    assert {"dropout", "module", "module_grad"} <= lacks and "grad" not in lacks
    assert data["clauses"]["numpy"]["11.1"]["passed"] == 2

    # Today's variants (SPEC §15-§19, and the log-sum-exp of §21): one row each, after the
    # verdict, both backends declaring all six.
    assert [(v["capability"], v["section"]) for v in data["variants"]] == [
        ("sinks", "15"),
        ("chunked", "16"),
        ("alibi", "17"),
        ("packed", "18"),
        ("paged", "19"),
        ("lse", "21"),
        ("merge", "22"),
    ]
    # Both declare every variant of §15-§19; numpy-flash declares no merge (§22).
    today = data["variants"][:5]
    assert all(v["backends"][b]["declared"] for v in today for b in data["backends"])
    assert data["variants"][6]["backends"]["numpy"]["declared"]
    assert md.index("## Verdict") < md.index("## Today's variants per backend")
    assert md.index("## Today's variants per backend") < md.index("## Clauses per backend")
    for v in data["variants"]:
        assert f"| `{v['capability']}` (§{v['section']}) | " in md
    assert "| §11.1 The worked example | ✅ 2/2 passed | ✅ 2/2 passed |" in md

    # Skips: one line per backend and missing capability, pairwise ones included.
    skips = data["skips"]
    keys = [(s["backend"], s["missing"]) for s in skips]
    assert len(keys) == len(set(keys))
    module = next(s for s in skips if s["missing"] == "capability module")
    assert module["backend"] == "numpy-flash" and module["pairwise"] > 0
    assert "12.10" in module["clauses"]  # the module gradients' pairwise test
    skip_lines = [line for line in md.splitlines() if line.startswith("- ") and "lacks" in line]
    assert len(skip_lines) == len(skips) and not any("~" in line for line in skip_lines)

    _check_measurements(data)
    rows = data["tests"]
    _check_agreement(data, md)

    # Pairwise tests (SPEC §7.3, §12.10) count in both backends' columns and in the pair's
    # own table, and once in the totals.
    assert sum(data["summary"].values()) == len(rows)
    pair_rows = [r for r in rows if r["clause"] == "7.3"]
    assert pair_rows and all(r["backend"] == "numpy~numpy-flash" for r in pair_rows)
    n = sum(r["outcome"] == "passed" for r in pair_rows)
    for column in ("numpy", "numpy-flash", "numpy~numpy-flash"):
        assert data["clauses"][column]["7.3"]["passed"] == n, column
    assert f"| §7.3 Backends agree pairwise | ✅ {n}/{n} passed | ✅ {n}/{n} passed |" in md
    assert "| numpy~numpy-flash |" in md.split("## Every pair on random inputs")[1]

    # JUnit XML for CI, one testcase per test, with the measurements as properties.
    suite = ET.parse(tmp_path / "junit.xml").getroot()
    cases = suite.findall(".//testcase")
    assert len(cases) == data["summary"]["passed"] + data["summary"]["skipped"]
    assert suite.findall(".//property[@name='conformance-measurement']")

    # Pictures, each linked from the Markdown.
    for name in (
        "masks.png",
        "worked-example-weights.png",
        "agreement-float32.png",
        "agreement-bfloat16.png",
        "gradient-agreement-float32.png",
    ):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
        assert f"]({name})" in md


def _check_measurements(data: dict) -> None:
    from conformance import load_backend

    # The agreement numbers are the tests' own: one measurement per comparison a fixture
    # test asserted, and the numbers are those of the comparison.
    rows = data["tests"]
    measured = data["measurements"]
    passed = {
        r["test"].split("[numpy-", 1)[1][:-1]
        for r in rows
        if r["backend"] == "numpy"
        and r["outcome"] == "passed"
        and "test_fixture_case[" in r["test"]
    }
    numpy_out = {m["case"] for m in measured if m["backend"] == "numpy" and m["quantity"] == "out"}
    assert passed and passed <= numpy_out
    from conformance.suite.cases import load_case

    case = load_case("gqa-H6-K2-float32")
    got = load_backend("numpy").attention(*case.inputs(), mask=case.mask(), **case.options())
    (m,) = [
        m for m in measured if (m["backend"], m["case"], m["quantity"]) == ("numpy", case.id, "out")
    ]
    assert m["error"] == max_error(got, case.expected) and 0 < m["error"] <= m["tolerance"]
    assert {m["quantity"] for m in measured if m["backend"] == "numpy"} >= {"out", "dq", "dmask"}


@pytest.mark.clause("13.5", "13.7")
def test_report_on_a_users_function_says_what_is_wrong(tmp_path):
    """The worked example without its known-failures file: the two failures, each with its
    message and a replay of the call on saved inputs, and the verdict names the clause."""
    run = _report(
        "--impl",
        "examples.my_attention:attention",
        "--impl-capabilities",
        "value_dim,causal_bottom_right,window,gqa",
        "--out",
        str(tmp_path),
        "-k",
        "bad_input or worked",
    )
    assert run.returncode == 1, run.stdout[-3000:] + run.stderr[-3000:]
    data = json.loads((tmp_path / "report.json").read_text())
    assert data["backends"] == ["my_attention.attention"]
    assert data["summary"]["failed"] == 2
    verdict = data["verdicts"]["my_attention.attention"]
    assert not verdict["conforms"] and verdict["failed_clauses"] == ["8.1"]
    md = (tmp_path / "report.md").read_text()
    assert "| my_attention.attention | ❌ **fails §8.1** (2 tests) |" in md
    # By layer (SPEC §13.18): the worked example (§11.1) is the math, the refusals the contract.
    layers = data["layers"]["my_attention.attention"]
    assert layers["math"].startswith("conforms (") and layers["edges"] == "not run"
    assert layers["contract"] == "departs on §8.1 (accepts 2 kinds of bad input)"
    assert "| my_attention.attention | conforms (" in md and "| departs on §8.1 (" in md
    # A function is not said to lack what only a Backend class can declare.
    assert not {"sharded", "module", "paged"} & set(verdict["lacks_capabilities"])
    # The departures come first: one line for both refusals, with its clause and a test.
    departures = md.index("## What each backend does differently from the spec")
    assert departures < md.index("## Clauses per backend")
    assert (
        "1. accepts, with no error, a uint8 mask; an int64 mask: §8.1 (2 tests; every call: "
        "float64); e.g. `conformance/tests/test_errors.py::test_bad_input["
        "my_attention.attention-integer-mask]`" in md
    )
    assert data["departures"]["my_attention.attention"][0]["covers"] == [
        "accepts a uint8 mask (no error)",
        "accepts an int64 mask (no error)",
    ]
    assert "## What failed, and how to reproduce it" in md
    assert "test_bad_input[my_attention.attention-integer-mask]" in md
    # A function that declares none of today's variants: each row says so.
    for variant in ("sinks", "chunked", "alibi", "packed", "paged"):
        assert re.search(rf"^\| `{variant}` \(§1[5-9]\) \| ➖ not declared", md, re.M), variant
    assert "mask=int64[5, 6]" in md and "load_call(" in md
    saved = sorted(p.name for p in (tmp_path / "repro").iterdir())
    assert len(saved) == 2 and all(name.endswith(".npz") for name in saved)
    failures = ET.parse(tmp_path / "junit.xml").getroot().findall(".//failure")
    assert len(failures) == 2


@pytest.mark.clause("13.4", "13.7")
def test_report_with_known_failures_passes(tmp_path):
    run = _report(
        "--impl",
        "examples.my_attention:attention",
        "--impl-capabilities",
        "value_dim,causal_bottom_right,window,gqa",
        "--known-failures",
        "examples/known_failures.txt",
        "--out",
        str(tmp_path),
        "-k",
        "bad_input",
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    data = json.loads((tmp_path / "report.json").read_text())
    assert data["summary"]["xfailed"] == 2 and data["summary"]["failed"] == 0
    md = (tmp_path / "report.md").read_text()
    assert "| §8.1 Bad input raises a clear error | ⚠️" in md
    assert "| ⚠️ known failures in §8.1, nothing else fails |" in md
    assert "known failure (§8.1, 1 test): integer masks are read as bool" in md
    # A known failure's reason cites the clause its test is counted under.
    for group in data["known_failures"]:
        cited = set(re.findall(r"§(\d+(?:\.\d+)*)", group["reason"]))
        assert cited <= set(group["clauses"]), group


@pytest.mark.clause("13.3")
def test_report_with_an_unknown_impl_is_an_error(tmp_path):
    run = _report("--impl", "no_such_module_xyz:f", "--out", str(tmp_path))
    assert run.returncode == 2 and "registered backends are" in run.stderr


@pytest.mark.clause("13.7")
def test_without_matplotlib_the_report_says_so(monkeypatch, tmp_path):
    from conformance.report import pictures as report_pictures
    from conformance.report.collect import OUTCOMES
    from conformance.report.markdown import render_markdown

    def no_matplotlib():
        raise ImportError("No module named 'matplotlib'")

    monkeypatch.setattr(report_pictures, "_pyplot", no_matplotlib)
    pictures = report_pictures.draw_pictures(tmp_path, {})
    assert "matplotlib is not installed" in pictures["error"]
    data = {
        "date": "today",
        "machine": "here",
        "command": "python -m conformance report",
        "versions": {},
        "summary": dict.fromkeys(OUTCOMES, 0),
        "exit_code": 0,
        "backends": [],
        "clauses": {},
        "tests": [],
        "pictures": pictures,
    }
    assert "no pictures: matplotlib is not installed" in render_markdown(data)
    assert not list(tmp_path.iterdir())


def _row(backend, clause, outcome, reason="", test="t"):
    return {
        "test": test,
        "backend": backend,
        "clause": clause,
        "outcome": outcome,
        "reason": reason,
    }


@pytest.mark.clause("13.7")
def test_a_pairwise_test_counts_for_both_backends_and_once_in_total():
    from conformance.report.outcomes import clause_table

    rows = [
        _row("a", "4.1", "passed"),
        _row("b", "4.1", "passed"),
        _row("a~b", "7.3", "passed"),
        _row("a~b", "7.3", "failed", "a vs b: too far"),
        _row("a~c", "12.10", "skipped", "a or c lacks capability 'grad'"),
    ]
    table = clause_table(rows)
    assert table["a"]["7.3"]["passed"] == table["b"]["7.3"]["passed"] == 1
    assert table["a"]["7.3"]["failed"] == table["b"]["7.3"]["failed"] == 1
    assert table["a~b"]["7.3"]["failed"] == 1 and "7.3" not in table["c"]
    assert table["c"]["12.10"]["skipped"] == table["a"]["12.10"]["skipped"] == 1
    assert table["a"]["4.1"]["passed"] == 1


@pytest.mark.clause("13.7", "15.6")
def test_variant_rows_count_each_section_and_say_what_is_not_declared():
    """The variants table sums a variant's SPEC section over its clauses, per backend, and
    a backend that does not declare it reads "not declared", with the refusal's test."""
    from conformance.report.markdown import render_variants
    from conformance.report.outcomes import clause_table, variants

    rows = [
        _row("a", "15.1", "passed"),
        _row("a", "15.5", "failed", "dsinks too far"),
        _row("b", "15.1", "skipped", "b lacks capability 'sinks'"),
        _row("b", "15.6", "passed"),
        _row("a", "19.1", "passed"),
        _row("b", "19.1", "passed"),
        _row("a", "4.1", "passed"),
    ]
    declared = {
        "a": {"capabilities": ["sinks", "paged"], "dtypes": []},
        "b": {"capabilities": ["paged"], "dtypes": []},
    }
    table = variants(clause_table(rows), declared)
    assert [v["capability"] for v in table] == [
        "sinks", "chunked", "alibi", "packed", "paged", "lse", "merge"
    ]  # fmt: skip
    sinks, paged = table[0]["backends"], table[4]["backends"]
    assert sinks["a"] == {"declared": True, "passed": 1, "failed": 1, "skipped": 0, "xfailed": 0}
    assert not sinks["b"]["declared"] and sinks["b"]["skipped"] == sinks["b"]["passed"] == 1
    assert paged["a"]["passed"] == paged["b"]["passed"] == 1
    md = "\n".join(render_variants(table, ["a", "b"]))
    assert (
        "| `sinks` (§15) | ❌ 1/2 passed, 1 failed | ➖ not declared (1/1 passed, 1 skipped) |"
        in md
    )
    assert "| `chunked` (§16) | ➖ not declared | ➖ not declared |" in md
    assert "| `paged` (§19) | ✅ 1/1 passed | ✅ 1/1 passed |" in md


@pytest.mark.clause("13.7")
def test_skips_are_grouped_by_the_backend_that_lacks_the_capability():
    """60 pairwise skips for one backend's missing capability are one line, charged to
    that backend and not to its partners; a failure shows in the verdict with its clause."""
    from conformance.report.outcomes import grouped_skips, verdicts

    declared = {
        "a": {"capabilities": ["grad", "window"], "dtypes": ["float64"]},
        "b": {"capabilities": ["grad", "window"], "dtypes": ["float64", "float32"]},
        "c": {"capabilities": ["window"], "dtypes": ["float64", "float32"]},
    }
    rows = [_row("a~c", "12.10", "skipped", "a or c lacks capability 'grad'")] * 30
    rows += [_row("b~c", "12.10", "skipped", "b or c lacks capability 'grad'")] * 30
    rows += [_row("c", "12.1", "skipped", "c lacks capability 'grad'")] * 5
    rows += [_row("a", "4.5", "skipped", "a lacks dtype 'float32'")] * 3
    rows += [
        _row("a", "4.1", "passed"),
        _row("b", "4.1", "failed", "wrong"),
        _row("c", "4.1", "passed"),
    ]
    skips = grouped_skips(rows, declared)
    assert [(s["backend"], s["missing"], s["tests"], s["pairwise"]) for s in skips] == [
        ("a", "dtype float32", 3, 0),
        ("c", "capability grad", 65, 60),
    ]
    assert skips[1]["clauses"] == ["12.1", "12.10"]
    v = verdicts(rows, declared)
    assert v["a"]["conforms"] and v["c"]["conforms"]
    assert not v["b"]["conforms"] and v["b"]["failed_clauses"] == ["4.1"]
    # A pairwise failure: the two disagree, and neither is said to fail a clause alone.
    v = verdicts([*rows, _row("a~c", "7.3", "failed", "a vs c: too far")], declared)
    assert not v["a"]["conforms"] and not v["c"]["conforms"] and v["b"]["apart_from"] == {}
    assert v["a"]["apart_from"] == {"c": {"tests": 1, "clauses": ["7.3"]}}
    assert v["c"]["apart_from"] == {"a": {"tests": 1, "clauses": ["7.3"]}}
    assert v["a"]["failed_clauses"] == v["c"]["failed_clauses"] == []
    assert "grad" in v["c"]["lacks_capabilities"] and v["a"]["lacks_dtypes"] == [
        "float32",
        "float16",
        "bfloat16",
    ]


@pytest.mark.clause("13.7")
def test_agreement_keeps_the_worst_comparison_and_names_it():
    from conformance.report.agreement import agreement

    def m(backend, case, error, tolerance, dtype="float32", quantity="out"):
        return {
            "backend": backend,
            "case": case,
            "dtype": dtype,
            "quantity": quantity,
            "error": error,
            "tolerance": tolerance,
            "unit": 2.0**-23,
        }

    measured = [
        m("a", "big-error-loose-tolerance", 1e-5, 1e-4),
        m("a", "small-error-tight-tolerance", 1e-7, 2e-7),
        m("a", "nan-output", float("inf"), 1e-6, dtype="float16"),
        m("a~b", "plain", 3e-7, 1e-6),
        m("a", "grad-case", 1e-6, 1e-6, quantity="dk"),
    ]
    result = agreement(measured, ["a", "b"])
    worst = result["outputs"]["float32"]["vs_oracle"]["a"]
    assert worst["case"] == "small-error-tight-tolerance" and worst["fraction_of_tolerance"] == 0.5
    assert worst["comparisons"] == 2 and worst["failed"] == 0
    assert worst["error_eps"] == pytest.approx(1e-7 * 2**23)
    assert result["outputs"]["float32"]["pairs"]["a~b"]["fraction_of_tolerance"] == 0.3
    f16 = result["outputs"]["float16"]["vs_oracle"]["a"]
    assert f16["failed"] == 1 and f16["fraction_of_tolerance"] == float("inf")
    assert result["gradients"]["float32"]["vs_oracle"]["a"]["quantity"] == "dk"


@pytest.mark.clause("13.7")
def test_heatmaps_share_one_colour_scale():
    """The same fraction of the tolerance has the same colour in every heatmap; beyond 1
    (a failing test) is red, a pair not compared is grey."""
    pytest.importorskip("matplotlib")
    from conformance.report.pictures import FAILS_COLOUR, NOT_COMPARED_COLOUR, cell_colours

    colours = cell_colours(np.array([[0.0, 0.5, 1.0], [1.5, np.inf, np.nan]]))
    assert colours[0, 0, :3].min() > 0.95  # white: nowhere near the tolerance
    assert colours[0, 2, :3].max() < colours[0, 1, :3].max() < colours[0, 0, :3].max()
    assert tuple(colours[1, 0]) == tuple(colours[1, 1]) == FAILS_COLOUR
    assert tuple(colours[1, 2]) == NOT_COMPARED_COLOUR
    assert np.array_equal(cell_colours(np.array([[0.5]]))[0, 0], colours[0, 1])


@pytest.mark.clause("13.7")
def test_a_heatmap_draws_no_pair_that_was_never_compared():
    """float16 and bfloat16 have no pairwise tests: their grid is one row, each backend
    against the oracle, not a matrix of grey cells; a dtype with pairs keeps the matrix."""
    from conformance.report.pictures import heatmap_grid

    def s(x):
        return {"fraction_of_tolerance": x}

    lone = {"vs_oracle": {"a": s(0.1), "b": s(0.2), "c": s(0.3)}, "pairs": {}}
    names, grid = heatmap_grid(lone)
    assert names == ["a", "b", "c"] and grid.tolist() == [[0.1, 0.2, 0.3]]
    paired = {**lone, "pairs": {"a~b": s(0.5)}}
    names, grid = heatmap_grid(paired)
    assert grid.shape == (3, 3) and grid[0, 1] == grid[1, 0] == 0.5 and np.isnan(grid[0, 2])


@pytest.mark.clause("13.7")
def test_clause_cells_read_as_counts_in_words():
    from conformance.report.markdown import clause_cell

    def cell(passed=0, failed=0, skipped=0, xfailed=0):
        return clause_cell(
            {"passed": passed, "failed": failed, "skipped": skipped, "xfailed": xfailed}
        )

    assert cell(15) == "✅ 15/15 passed"
    assert cell(74, skipped=6) == "✅ 74/74 passed, 6 skipped"
    assert cell(20, skipped=2, xfailed=2) == "⚠️ 20/22 passed, 2 known failures, 2 skipped"
    assert cell(3, failed=1, xfailed=1) == "❌ 3/5 passed, 1 failed, 1 known failure"
    assert cell(skipped=5) == "➖ 5 skipped"


@pytest.mark.clause("13.7")
def test_pairs_are_listed_in_the_order_of_the_backends():
    from conformance.report.markdown import render_pairs

    one = {"7.3": {"passed": 1, "failed": 0, "skipped": 0, "xfailed": 0}}
    clauses = {p: one for p in ("b~c", "a~c", "numpy", "b~a", "a~b")}
    rows = [line.split(" | ")[0] for line in render_pairs(clauses, ["a", "b", "c"])[6:-1]]
    assert rows == ["| a~b", "| a~c", "| b~a", "| b~c"]


@pytest.mark.clause("13.7")
def test_a_measurement_is_what_assert_within_judges():
    """NaN where a number is expected is infinitely wrong; a NaN that is expected matches."""
    expected = np.array([1.0, np.nan, 3.0])
    assert max_error(np.array([1.5, np.nan, 3.0]), expected) == 0.5
    assert max_error(np.array([1.0, 2.0, 3.0]), expected) == float("inf")
    assert max_error(np.array([np.nan, np.nan, 3.0]), expected) == float("inf")
    assert max_error(np.zeros(2), expected) == float("inf")


@pytest.mark.clause("14.2")
def test_shard_count_table_keeps_the_worst_difference_per_p():
    from conformance.report.agreement import VS_ONE_SHARD, agreement, shard_counts
    from conformance.report.markdown import render_shard_counts

    def m(P, variant, error, tolerance=1e-15):
        return {
            "backend": "torch-ring", "case": f"P={P} {variant}", "dtype": "float64",
            "quantity": VS_ONE_SHARD, "error": error, "tolerance": tolerance, "unit": 2.2e-16,
        }  # fmt: skip

    found = shard_counts([m(2, "plain", 1e-16), m(2, "causal", 5e-16), m(10, "plain", 0.0)])
    assert list(found["torch-ring"]) == ["2", "10"]  # numeric order of P
    worst = found["torch-ring"]["2"]
    assert worst["case"] == "P=2 causal" and worst["comparisons"] == 2
    assert worst["fraction_of_tolerance"] == pytest.approx(0.5)
    # They are not outputs against the oracle: the agreement tables leave them out.
    assert agreement([m(2, "plain", 1e-16)], ["torch-ring"]) == {"outputs": {}, "gradients": {}}
    md = "\n".join(render_shard_counts(found))
    assert "| torch-ring | 2 | 5e-16 (`P=2 causal`) |" in md


@pytest.mark.clause("13.15", "13.16")
def test_one_cause_across_dtypes_is_one_departure():
    """A misreading the diagnosis names in three dtypes is one line, which says so."""
    from conformance.report.markdown import departure_line
    from conformance.report.outcomes import departures

    cause = (
        "is_causal is ignored when a mask is given: the output equals attention with the mask alone"
    )
    rows = [
        {
            "test": f"test_fixtures.py::test_fixture_case[f-causal-bool-mask-{dtype}]",
            "backend": "f",
            "clause": "3.4",
            "outcome": "failed",
            "reason": "",
            "message": "",
            "behaviour": cause,
            "reproduce": "",
            "call": [dtype, "bool mask", "is_causal"],
        }
        for dtype in ("float64", "float32", "float16")
    ]
    (entry,) = departures(rows)["f"]
    assert entry["dtypes"] == ["float64", "float32", "float16"]
    assert departure_line(entry) == (
        f"{cause}: §3.4 (3 tests; every call: bool mask, is_causal; 3 dtypes: float64, "
        "float32, float16)"
    )


# --- A report without noise (issue 39 item 8) --------------------------------------------------


def _numpy_function(q, k, v, *, mask=None, is_causal=False, scale=None):
    return q


@pytest.mark.clause("13.7")
def test_a_function_lacks_only_what_a_function_can_declare():
    """A function (``--impl``, a profile) is never said not to declare the sharded entry
    points, the layers or the paged cache, which only a Backend class can have; a Backend
    is held to every capability, as before."""
    from conformance import load_backend
    from conformance.adapters.function import FunctionBackend
    from conformance.backends import CAPABILITIES
    from conformance.report.command import declarable
    from conformance.report.outcomes import verdicts

    function = FunctionBackend(_numpy_function, "f", capabilities=["gqa"])
    assert declarable(load_backend("numpy")) == frozenset(CAPABILITIES)
    internal = {"sharded", "sharded_heads", "module", "module_grad", "paged"}
    assert not internal & declarable(function)
    assert {"grad", "grad_mask"}.isdisjoint(declarable(function))  # NumPy: no autograd
    torch_like = FunctionBackend(_numpy_function, "g", framework="torch")
    assert {"grad", "grad_mask", "grad_softcap"} <= declarable(torch_like)
    declared = {
        "f": {
            "capabilities": ["gqa"],
            "dtypes": ["float64"],
            "declarable": sorted(declarable(function)),
        },
        "numpy": {"capabilities": ["gqa"], "dtypes": ["float64"]},
    }
    v = verdicts([_row("f", "4.1", "passed"), _row("numpy", "4.1", "passed")], declared)
    assert not internal & set(v["f"]["lacks_capabilities"]), v["f"]["lacks_capabilities"]
    assert "window" in v["f"]["lacks_capabilities"] and "gqa" not in v["f"]["lacks_capabilities"]
    assert internal <= set(v["numpy"]["lacks_capabilities"])


@pytest.mark.clause("13.7")
def test_no_blank_clause_rows_and_no_one_cell_pictures(tmp_path):
    """A clause whose only tests are pairwise, in a run of one backend, has no row (the
    skips say why); a dtype compared for one backend alone gets its table and no heatmap."""
    from conformance.report import markdown
    from conformance.report import pictures as report_pictures

    data = {
        "backends": ["f"],
        "clauses": {
            "f": {"4.1": {"passed": 2, "failed": 0, "skipped": 0, "xfailed": 0}},
            None: {"8.4": {"passed": 0, "failed": 0, "skipped": 3, "xfailed": 0}},
        },
    }
    text = "\n".join(markdown.render_clauses(data))
    assert "§4.1" in text and "§8.4" not in text, text
    pytest.importorskip("matplotlib")
    from conformance.report.agreement import agreement

    def measured(backend, dtype, error):
        return {
            "backend": backend,
            "dtype": dtype,
            "quantity": "out",
            "case": "c",
            "error": error,
            "tolerance": 1.0,
            "unit": 1e-16,
        }

    blocks = agreement(
        [
            measured("f", "float64", float("inf")),
            measured("f", "float32", 0.5),
            measured("g", "float32", 0.25),
        ],
        ["f", "g"],
    )["outputs"]
    one, two = blocks["float64"], blocks["float32"]
    files = report_pictures.draw_pictures(tmp_path, {"outputs": {"float64": one, "float32": two}})
    assert "agreement-float64" not in files and not (tmp_path / "agreement-float64.png").exists()
    assert (tmp_path / files["agreement-float32"]).exists()
    lines = markdown.render_agreement({"float64": one}, files, "outputs")
    assert not any(line.startswith("![") for line in lines)
    assert "a heatmap of one cell would show nothing more" in "\n".join(lines)


@pytest.mark.clause("13.7", "20.6")
def test_report_says_what_a_normalised_p_pipeline_costs(tmp_path):
    """numpy-fp8 declaring the normalised P pipeline (SPEC §20.6 (c)) on v = c at S = 4,096:
    every weight is near 2⁻¹², below half e4m3's smallest subnormal 2⁻⁹, so the pipeline
    rounds every P to 0 and returns 0: its bound is 2c + float32's floor, where
    FlashAttention-3's pipeline, P · 2⁸ near 1, is held to a bound a hundred times smaller.
    The report names the declared pipeline, the case and the ratio of the bounds."""
    run = _report(
        "--backend",
        "numpy-fp8",
        "--backend-option",
        "numpy-fp8:pipeline='e4m3_normalized'",
        "--workers",
        "1",
        "--out",
        str(tmp_path),
        "-k",
        "test_constant_v_gives_the_constant_on_long_diffuse_rows and 4096",
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    data = json.loads((tmp_path / "report.json").read_text())
    costs = data["pipeline_costs"]["numpy-fp8"]
    c = 1.5 * float(np.float32(0.37))  # the test's v: code 1.5, descale 0.37
    assert costs["pipeline"] == "e4m3_normalized" and costs["comparisons"] == 1
    (case,) = costs["cases"]
    assert case["case"] == f"v = {c:.4g} everywhere, S = 4096"
    assert case["error"] == pytest.approx(c, rel=1e-6)  # the page returns 0 too
    assert case["bounds"]["e4m3_normalized"] == pytest.approx(2 * c + 8 * 2**-23, rel=1e-12)
    assert case["bounds"]["e4m3_unnormalized"] < c / 100
    assert case["bounds"]["float32"] < 1e-5
    ratio = costs["cost"]["e4m3_unnormalized"]["ratio"]
    assert ratio == pytest.approx(
        case["bounds"]["e4m3_normalized"] / case["bounds"]["e4m3_unnormalized"]
    )
    md = (tmp_path / "report.md").read_text()
    assert "## Quantized attention: what the declared P pipeline costs (SPEC §20.6)" in md
    assert "| numpy-fp8 | e4m3_normalized | 1 | " in md
    assert f"{ratio:.3g}× e4m3_unnormalized's (`{case['case']}`)" in md


@pytest.mark.clause("13.7", "13.19")
def test_the_report_says_what_a_kernel_was_judged_on(tmp_path):
    """A kernel with a domain (tests/test_domain.py's no-mask kernel of D in {16, 32} and S
    a multiple of 16): the report says what it was judged on and the clauses no call of
    theirs reached, as the run's summary does."""
    from test_domain import KERNELS, TILED

    (tmp_path / "kern.py").write_text(KERNELS.format(drop_scale=False, leak=False))
    (tmp_path / "kern.toml").write_text(TILED)
    run = subprocess.run(
        [sys.executable, "-m", "conformance", "report", "--impl-profile", "kern.toml"]
        + ["--out", str(tmp_path / "out"), "--workers", "1", "-k", "test_fixture_case"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env={**os.environ, "KERNEL_LOG": str(tmp_path / "calls.jsonl")},
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    data = json.loads((tmp_path / "out" / "report.json").read_text())
    judged = data["domains"]["kern.tiled"]
    assert judged["on"][-1] == "shapes D, E in {16, 32}; S a multiple of 16"
    assert "large-logits-float64" in judged["rebuilt"]
    assert judged["untested"] == ["2.5", "3.1", "3.2", "3.7", "3.8", "4.3"]
    md = (tmp_path / "out" / "report.md").read_text()
    section = md[md.index("## What each function was judged on") :]
    assert "- `kern.tiled`: dtypes float64, float32; forms it does not take: a bool mask" in section
    assert "**Untested**, no call of theirs fits what it takes: SPEC §2.5, §3.1, §3.2" in section


@pytest.mark.clause("13.7", "13.19")
def test_the_report_takes_an_impls_forms_and_domain_as_pytest_does(tmp_path):
    """``--impl-mask``, ``--impl-causal`` and ``--impl-domain`` reach the report's run: the
    no-mask kernel of D in {16, 32} and S a multiple of 16 (which asserts inside itself that
    it gets nothing else) is judged on its domain, named by the same flags as in pytest;
    without --impl they are an error, as in pytest."""
    from test_domain import KERNELS

    (tmp_path / "kern.py").write_text(KERNELS.format(drop_scale=False, leak=False))
    domain = ["--impl-domain", "head_dims=[16, 32]", "--impl-domain", "s_multiple=16"]
    flags = ["--impl-mask", "none", "--impl-causal", "keyword", *domain]
    run = subprocess.run(
        [sys.executable, "-m", "conformance", "report", "--impl", "kern:tiled", *flags]
        + ["--impl-name", "kern.tiled", "--impl-dtypes", "float64,float32"]
        + ["--out", str(tmp_path / "out"), "-k", "test_fixture_case"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env={**os.environ, "KERNEL_LOG": str(tmp_path / "calls.jsonl")},
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    calls = [json.loads(line) for line in (tmp_path / "calls.jsonl").read_text().splitlines()]
    assert calls and all(c["q"][-1] in (16, 32) and c["k"][-2] % 16 == 0 for c in calls)
    data = json.loads((tmp_path / "out" / "report.json").read_text())
    judged = data["domains"]["kern.tiled"]
    assert judged["on"][-1] == "shapes D, E in {16, 32}; S a multiple of 16"
    assert "forms it does not take: a bool mask; an additive float mask" in judged["on"]
    assert data["verdicts"]["kern.tiled"]["conforms"]

    alone = _report("--impl-domain", "s_multiple=16", "--backend", "numpy", "--out", str(tmp_path))
    assert alone.returncode == 2
    assert "--impl-domain describes an --impl; give --impl MODULE:ATTR" in alone.stderr


@pytest.mark.clause("13.7", "13.18")
def test_the_reports_verdict_counts_the_interpreters_failures_apart():
    """A failure named as its interpreter's known limitation (SPEC §13.19) is neither a
    failed clause nor a conforming test in the report's verdict: counted apart, by name."""
    from conformance.adapters.interpreters import INTERPRETERS
    from conformance.report.markdown import render_verdicts
    from conformance.report.outcomes import verdicts

    triton = INTERPRETERS["triton"]
    sentence, words = triton.limitations[0].sentence, f"tl.dot on bfloat16, {triton.version()}"
    declared = {"k": {"capabilities": [], "dtypes": ["float32", "bfloat16"]}}
    spoiled = {**_row("k", "11.1", "failed"), "behaviour": sentence}
    rows = [_row("k", "4.1", "passed"), spoiled, {**spoiled, "outcome": "xfailed"}]
    v = verdicts(rows, declared)["k"]
    assert v["conforms"] and v["ran"] == 1 and v["failed_clauses"] == []
    assert v["known_failure_clauses"] == []
    assert v["interpreter"] == {"tests": 2, "limitations": [words]}
    (line,) = [x for x in render_verdicts({"k": v}) if x.startswith("| k |")]
    assert (
        f"✅ conforms: 1 test, none failed; ➖ 2 tests its interpreter cannot run right: {words}"
        in line
    )
    # Only the interpreter's failures ran: the kernel conforms on nothing, and no test is
    # said not to have run.
    alone = verdicts([spoiled], declared)["k"]
    assert not alone["conforms"] and alone["failed_clauses"] == []
    (line,) = [x for x in render_verdicts({"k": alone}) if x.startswith("| k |")]
    assert f"| k | ➖ 1 test its interpreter cannot run right: {words} |" in line
    # The kernel's own failure stays its own.
    own = verdicts([*rows, {**_row("k", "6.3", "failed"), "behaviour": "fails"}], declared)["k"]
    assert not own["conforms"] and own["failed_clauses"] == ["6.3"]
