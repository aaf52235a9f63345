"""The table of how other libraries' functions meet the spec (docs/other-libraries.md) is
made from a run of the spec on their profiles (``python -m conformance frameworks``;
``tox -e frameworks`` checks the committed table against a fresh run). Here: how a run becomes the table, and
how its failures become a profile's known failures."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from conformance import frameworks
from conformance.adapters.profiles import read_profile, shipped_profiles
from conformance.suite.known_failures import pattern

ROOT = Path(__file__).resolve().parent.parent


def _row(backend, test, clause, outcome, behaviour=""):
    return {
        "backend": backend,
        "test": f"conformance/tests/test_x.py::{test}",
        "clause": clause,
        "outcome": outcome,
        "reason": f"known failure: {behaviour}" if outcome == "xfailed" else "",
        "message": "max abs error 3.1e-05 at index (0, 1)" if behaviour else "",
        "behaviour": behaviour,
        "call": ["float64"],
        "reproduce": "",
    }


def _data(rows):
    return {"versions": {"torch": "9.9"}, "tests": rows}


ACCEPTS = "accepts an int64 mask (no error)"
PRECISION = "computes float64 at float32 precision"


def test_cells_say_passes_fails_or_not_declared():
    rows = [
        _row("torch.sdpa", "test_a[torch.sdpa-1]", "4.3", "passed"),
        _row("torch.sdpa", "test_a[torch.sdpa-2]", "4.3", "xfailed", ACCEPTS),
        _row("torch.sdpa", "test_b[torch.sdpa]", "2.5", "passed"),
        _row("torch.sdpa", "test_c[torch.sdpa]", "3.6", "skipped"),
        _row("numpy", "test_a[numpy-1]", "4.3", "failed", ACCEPTS),  # not a profile
    ]
    found = frameworks.matrix(_data(rows))
    # A column per shipped profile, except one needing hardware this machine lacks (the
    # torch.context_parallel profile without CUDA), which gets a line saying why.
    assert set(found["functions"]) | set(found["elsewhere"]) == set(shipped_profiles())
    assert not set(found["functions"]) & set(found["elsewhere"])
    assert "torch 9.9" in found["functions"]["torch.sdpa"]
    cells = {clause: by_name["torch.sdpa"] for clause, by_name in found["clauses"].items()}
    assert cells == {
        "4.3": (frameworks.FAIL, "1/2 (#1)"),
        "2.5": (frameworks.PASS, ""),
        "3.6": (frameworks.NONE, "not declared"),
    }
    table = frameworks.table(found)
    assert "| §4.3 " in table and "❌ 1/2 (#1)" in table
    line = "1. accepts, with no error, an int64 mask: §4.3 (1 test, all known failures; every call: float64)"
    assert line in table
    conforming = next(line for line in table.splitlines() if line.startswith("No function"))
    assert "| §2.5 " not in table and "§2.5" in conforming  # passed by all: listed
    for name, why in found["elsewhere"].items():
        assert f"Not run here: `{name}`, {why}" in table.splitlines()


def test_a_clause_outside_a_kernels_domain_reads_untested_not_undeclared():
    """A clause whose tests were all skipped because no call of theirs fits the kernel's
    shapes is untested, which the cell says; a form the kernel does not take is not
    declared; a clause with one test run is judged on that test."""
    from conformance.suite.domain import LACKS_FORM, OUTSIDE

    outside = f"{OUTSIDE} pallas.gpu.mha (T a multiple of 16): T = 5; an empty sequence ..."
    lacks = f"pallas.gpu.mha {LACKS_FORM} 'mask_bool': a bool mask"
    rows = [
        {**_row("pallas.gpu.mha", "test_a[pallas.gpu.mha-1]", "2.5", "skipped"), "reason": outside},
        {**_row("pallas.gpu.mha", "test_b[pallas.gpu.mha-1]", "3.1", "skipped"), "reason": lacks},
        {**_row("pallas.gpu.mha", "test_c[pallas.gpu.mha-1]", "4.7", "skipped"), "reason": outside},
        _row("pallas.gpu.mha", "test_c[pallas.gpu.mha-2]", "4.7", "passed"),
    ]
    found = frameworks.matrix(_data(rows))
    cells = {clause: by_name["pallas.gpu.mha"] for clause, by_name in found["clauses"].items()}
    assert cells == {
        "2.5": (frameworks.NONE, "untested: no call of it fits the domain"),
        "3.1": (frameworks.NONE, "not declared"),
        "4.7": (frameworks.PASS, ""),
    }


def test_a_clause_outside_a_profiles_default_run_says_so():
    """A compiled-per-shape profile's tests outside its [run] tests are skipped: the cell
    says they were not in its default run, not that the clause is undeclared."""
    from conformance.suite.known_failures import NOT_IN_DEFAULT_RUN

    skipped = f"{NOT_IN_DEFAULT_RUN} torch.compile.sdpa, which compiles per shape: ..."
    rows = [
        {**_row("torch.compile.sdpa", "test_a[torch.compile.sdpa-1]", "4.3", "skipped"),
         "reason": skipped},
        _row("torch.compile.sdpa", "test_fixture_case[torch.compile.sdpa-1]", "2.5", "passed"),
    ]  # fmt: skip
    found = frameworks.matrix(_data(rows))
    cells = {c: by_name["torch.compile.sdpa"] for c, by_name in found["clauses"].items()}
    assert cells == {
        "4.3": (frameworks.NONE, "not in its default run"),
        "2.5": (frameworks.PASS, ""),
    }


def test_departures_are_numbered_by_how_many_tests_show_them():
    rows = [
        _row("torch.sdpa", "test_a[torch.sdpa-1]", "4.3", "failed", ACCEPTS),
        _row("torch.sdpa", "test_a[torch.sdpa-2]", "4.3", "failed", PRECISION),
        _row("torch.sdpa", "test_b[torch.sdpa-3]", "6.5", "failed", PRECISION),
    ]
    for order in (rows, rows[::-1]):
        found = frameworks.matrix(_data(order))
        listed = [e["behaviour"] for e in found["departures"]["torch.sdpa"]]
        assert listed == [PRECISION, "accepts, with no error, an int64 mask"]
        assert found["clauses"]["4.3"]["torch.sdpa"] == (frameworks.FAIL, "2/2 (#1, #2)")
        assert found["clauses"]["6.5"]["torch.sdpa"] == (frameworks.FAIL, "1/1 (#1)")
    assert frameworks.departure_lines(frameworks.block(found)) == {
        ("torch.sdpa", PRECISION),
        ("torch.sdpa", "accepts, with no error, an int64 mask"),
    }


def test_refusals_of_one_kind_share_a_line():
    rows = [
        _row("torch.sdpa", "test_a[torch.sdpa-1]", "8.1", "failed", ACCEPTS),
        _row("torch.sdpa", "test_a[torch.sdpa-2]", "8.1", "failed", "accepts scale = 0 (no error)"),
        _row(
            "torch.sdpa",
            "test_a[torch.sdpa-3]",
            "8.1",
            "failed",
            "raises Fail, not ValueError, for a q of rank 2",
        ),
        _row(
            "torch.sdpa",
            "test_a[torch.sdpa-4]",
            "8.1",
            "failed",
            "raises Fail, not ValueError, for a q of rank 5",
        ),
    ]
    found = frameworks.matrix(_data(rows))
    listed = [(e["behaviour"], e["tests"]) for e in found["departures"]["torch.sdpa"]]
    assert listed == [
        ("accepts, with no error, an int64 mask; scale = 0", 2),
        ("raises Fail, not ValueError, for a q of rank 2; a q of rank 5", 2),
    ]
    assert found["clauses"]["8.1"]["torch.sdpa"] == (frameworks.FAIL, "4/4 (#1, #2)")


def test_marks_read_back_and_the_page_rewrites_only_the_table(tmp_path):
    rows = [
        _row("torch.sdpa", "test_a[torch.sdpa]", "4.3", "xfailed", ACCEPTS),
        _row(
            "jax.nn.dot_product_attention", "test_a[jax.nn.dot_product_attention]", "4.3", "passed"
        ),
    ]
    found = frameworks.matrix(_data(rows))
    marks = frameworks.marks(frameworks.block(found))
    assert marks["§4.3", "torch.sdpa"] == frameworks.FAIL
    assert marks["§4.3", "jax.nn.dot_product_attention"] == frameworks.PASS
    page = tmp_path / "other-libraries.md"
    page.write_text(
        f"# Title\n\nbefore\n\n{frameworks.START}\nstale | table\n{frameworks.END}\n\nafter\n"
    )
    assert frameworks.rewrite_page(page, found)
    text = page.read_text()
    assert text.startswith("# Title\n\nbefore\n\n") and text.endswith("\n\nafter\n")
    assert "stale" not in text and frameworks.marks(text) == marks
    assert not frameworks.rewrite_page(page, found)  # a second run changes nothing


def test_the_pages_table_has_a_column_per_shipped_profile():
    """The committed table is a run of every shipped profile (``tox -e frameworks`` checks
    its marks against a fresh run; here, that it has them all)."""
    text = (ROOT / "docs" / "other-libraries.md").read_text(encoding="utf-8")
    marks = frameworks.marks(text)
    assert marks, "no table between the page's frameworks-table markers"
    block = text.split(frameworks.START, 1)[1].split(frameworks.END, 1)[0]
    elsewhere = set(re.findall(r"^Not run here: `([^`]+)`, needs ", block, flags=re.M))
    assert {name for _, name in marks} | elsewhere == set(shipped_profiles())
    assert set(marks.values()) <= {frameworks.PASS, frameworks.FAIL, frameworks.NONE}


def test_known_failures_cover_exactly_what_failed(tmp_path):
    """A function whose every run fails with one behaviour gets one wildcard entry;
    otherwise one entry per failing test; each entry's reason is the behaviour; and the
    entries, as the plugin matches them, hit the failures only."""
    p = "torch.sdpa"
    rows = [
        _row(p, f"test_all[{p}-a]", "4.3", "failed", PRECISION),
        _row(p, f"test_all[{p}-b]", "4.3", "failed", PRECISION),
        _row(p, f"test_all[{p}-c]", "4.3", "skipped"),
        _row(p, f"test_some[{p}-a]", "8.1", "failed", ACCEPTS),
        _row(p, f"test_some[{p}-b]", "8.1", "passed"),
        _row(p, f"test_mixed[{p}-a]", "3.1", "failed", ACCEPTS),
        _row(p, f"test_mixed[{p}-b]", "3.1", "failed", PRECISION),
        _row(p, f"test_ok[{p}]", "2.5", "passed"),
    ]
    entries = frameworks.known_failures(_data(rows), p)
    assert entries == {
        f"test_all[{p}-*]": PRECISION,
        f"test_mixed[{p}-a]": ACCEPTS,
        f"test_mixed[{p}-b]": PRECISION,
        f"test_some[{p}-a]": ACCEPTS,
    }
    for row in rows:
        name = row["test"].rpartition("::")[2]
        hit = any(pattern(entry).match(name) for entry in entries)
        if row["outcome"] != "skipped":  # a skip is a skip with or without an entry
            assert hit == (row["outcome"] == "failed"), name


def test_a_known_failure_with_another_behaviour_is_stale():
    rows = [
        _row("torch.sdpa", "test_a[torch.sdpa-1]", "4.3", "xfailed", ACCEPTS),
        {
            **_row("torch.sdpa", "test_a[torch.sdpa-2]", "4.3", "xfailed", ACCEPTS),
            "behaviour": PRECISION,
        },
    ]
    stale = frameworks.stale_reasons(_data(rows))
    assert len(stale) == 1 and "test_a[torch.sdpa-2]" in stale[0] and PRECISION in stale[0]


def test_writing_known_failures_keeps_the_rest_of_the_profile(tmp_path):
    path = tmp_path / "torch.sdpa.toml"
    shutil.copy(read_profile("torch.sdpa").path, path)
    before = read_profile(path)
    entries = {"test_x[torch.sdpa-*]": 'raises RuntimeError: "quoted" \\ text'}
    frameworks.write_known_failures(path, entries)
    after = read_profile(path)
    assert after.known_failures == entries
    assert (after.target, after.call, after.capabilities, after.dtypes) == (
        before.target,
        before.call,
        before.capabilities,
        before.dtypes,
    )
    head = path.read_text().split("[known_failures]")[0]
    assert head == before.path.read_text().split("[known_failures]")[0]


def test_processor_dependent_tests_read_the_same_failed_or_passed():
    """A test listed as processor-dependent is no ✅/❌ and no departure, but a line of
    its own under the function's departures, the same whether it failed or passed here;
    ``--check`` reads that line back; ``--update-profiles`` leaves it to the profile."""
    p = "torch.sdpa"
    varies = frameworks.ON_SOME_PROCESSORS + "a NaN in the inputs becomes a number in the output"

    def run(outcome):
        rows = [
            _row(p, f"test_nan[{p}-float32]", "4.9", "xfailed", ACCEPTS),
            {**_row(p, f"test_nan[{p}-float64-a]", "4.9", outcome), "reason": varies},
            {**_row(p, f"test_nan[{p}-float64-b]", "4.9", "xfailed"), "reason": varies},
            _row(p, f"test_ok[{p}]", "2.5", "passed"),
        ]
        return rows, frameworks.matrix(_data(rows))

    (rows, failed), (_, passed) = run("xfailed"), run("passed")
    assert frameworks.block(failed) == frameworks.block(passed)
    assert failed["clauses"]["4.9"][p] == (frameworks.FAIL, "1/1 (#1)")
    assert [e["covers"] for e in failed["departures"][p]] == [[ACCEPTS]]
    line = f"{frameworks.VARIES}a NaN in the inputs becomes a number in the output: §4.9 (2 tests)"
    assert line in frameworks.table(failed).splitlines()
    assert (p, varies) in frameworks.departure_lines(frameworks.block(failed))
    failing = [{**r, "outcome": "failed", "reason": ""} for r in rows if r["outcome"] != "passed"]
    entries = frameworks.known_failures(_data(failing), p, [f"test_nan[{p}-float64-*]"])
    assert entries == {f"test_nan[{p}-float32]": ACCEPTS}


def test_tests_that_vary_from_run_to_run_are_named_by_their_cause_apart():
    """A ``[varies_between_runs]`` test (OpenVINO's S = 0: an output buffer returned
    unwritten) is no ✅/❌ either, but a line under its own label, not "on some
    processors": its cause, then what the runs showed. ``--check`` reads it back, and a run
    that shows a behaviour the entry does not list is stale."""
    p = "openvino.ScaledDotProductAttention"
    cause = "with no keys (S = 0) it returns its output buffer unwritten"
    shown = "a query with no key to attend returns NaN, not 0"
    varies = frameworks.FROM_RUN_TO_RUN + f"{cause}; {shown}"

    def run(outcome, behaviour=shown):
        rows = [
            {**_row(p, f"test_empty[{p}-S0-a]", "2.5", outcome, behaviour), "reason": varies},
            _row(p, f"test_ok[{p}]", "2.5", "passed"),
        ]
        return rows, frameworks.matrix(_data(rows))

    (_, failed), (_, passed) = run("xfailed"), run("passed")
    assert frameworks.block(failed) == frameworks.block(passed)
    assert failed["clauses"]["2.5"][p] == (frameworks.PASS, "")
    assert failed["departures"][p] == [] and failed["processor_dependent"][p] == []
    line = f"{frameworks.BY_RUN}{cause} (seen: {shown}): §2.5 (1 tests)"
    assert line in frameworks.table(failed).splitlines()
    assert frameworks.VARIES not in frameworks.table(failed)
    read = frameworks.FROM_RUN_TO_RUN + f"{cause} (seen: {shown})"
    assert (p, read) in frameworks.departure_lines(frameworks.block(failed))
    assert frameworks.stale_reasons(_data(run("xfailed")[0])) == []
    other = "a query with no key to attend returns a row that is not 0"
    assert len(frameworks.stale_reasons(_data(run("xfailed", other)[0]))) == 1


def test_update_profiles_does_not_rewrite_or_check_the_page(capsys):
    """A run that re-measures the known failures ignores them, so its table (counts, the
    processor-dependent lines) is not the page's: the command refuses before running."""
    for flag in ("--page", "--readme", "--check"):
        with pytest.raises(SystemExit) as exit_info:
            frameworks.main(["--update-profiles", flag, "docs/other-libraries.md"])
        assert exit_info.value.code == 2
        assert "in a run of its own" in capsys.readouterr().err
