"""SPEC §11.2: fixtures regenerate byte for byte, and a corrupted file is refused."""

from __future__ import annotations

import io
import json
import shutil

import numpy as np
import pytest
from conformance.fixtures import generate

from conformance.suite import cases

pytestmark = pytest.mark.clause("11.2")


def _npz_differences(fresh: bytes, stored: bytes) -> list[str]:
    """Each field of two .npz files that differs, with where and both values."""
    with (
        np.load(io.BytesIO(fresh), allow_pickle=False) as a,
        np.load(io.BytesIO(stored), allow_pickle=False) as b,
    ):
        found = [f"field {n!r} only in one file" for n in sorted(set(a.files) ^ set(b.files))]
        for name in sorted(set(a.files) & set(b.files)):
            x, y = a[name], b[name]
            if x.shape != y.shape or x.dtype != y.dtype:
                found.append(
                    f"field {name!r}: {x.dtype}{x.shape} regenerated, {y.dtype}{y.shape} stored"
                )
                continue
            differ = ~((x == y) | (np.isnan(x) & np.isnan(y)) if x.dtype.kind == "f" else x == y)
            if differ.any():
                at = tuple(int(i) for i in np.argwhere(differ)[0])
                found.append(
                    f"field {name!r} at {at} ({int(differ.sum())} elements): regenerated "
                    f"{x[at]!r}, stored {y[at]!r}"
                )
        return found


def _manifest_differences(fresh: dict, stored: dict) -> list[str]:
    found = []
    for key in sorted(set(fresh) | set(stored)):
        if fresh.get(key) != stored.get(key):
            found.append(
                f"field {key!r}: regenerated {fresh.get(key)!r}, stored {stored.get(key)!r}"
            )
    return found


def test_regenerating_reproduces_identical_files(tmp_path):
    """Every stored number is exact on any CPU, BLAS kernel and thread count (SPEC §11.2):
    a mismatch names the case, the field and both values."""
    generate.generate(tmp_path)
    committed = json.loads((cases.FIXTURES / "manifest.json").read_text())
    regenerated = json.loads((tmp_path / "manifest.json").read_text())
    problems = []
    for entry in committed["cases"] + [committed["worked_example"]]:
        fresh = (tmp_path / entry["file"]).read_bytes()
        stored = (cases.FIXTURES / entry["file"]).read_bytes()
        if fresh != stored:
            what = _npz_differences(fresh, stored) if entry["file"].endswith(".npz") else []
            problems += [f"{entry['file']}: {p}" for p in what or ["bytes differ"]]
    fresh_entries = {e["id"]: e for e in regenerated["cases"]}
    for entry in committed["cases"]:
        new = fresh_entries.pop(entry["id"], None)
        if new is None:
            problems.append(f"case {entry['id']!r}: no longer generated")
        else:
            problems += [f"case {entry['id']!r}: {p}" for p in _manifest_differences(new, entry)]
    problems += [f"case {cid!r}: generated but not in manifest.json" for cid in fresh_entries]
    rest = {k: v for k, v in regenerated.items() if k != "cases"}
    problems += _manifest_differences(rest, {k: v for k, v in committed.items() if k != "cases"})
    assert not problems, "a fresh regeneration differs from the committed fixtures:\n" + "\n".join(
        problems[:40]
    )


def test_every_listed_file_exists_and_nothing_else(tmp_path):
    listed = {e["file"] for e in cases.manifest()["cases"]}
    on_disk = {f"cases/{p.name}" for p in (cases.FIXTURES / "cases").glob("*.npz")}
    assert listed == on_disk


@pytest.mark.parametrize("where", ["cases/T7-S7-float64.npz", "worked_example.json"])
def test_corrupted_file_is_detected(tmp_path, where):
    root = tmp_path / "fixtures"
    shutil.copytree(cases.FIXTURES, root, ignore=shutil.ignore_patterns("*.py", "__pycache__"))
    data = bytearray((root / where).read_bytes())
    data[len(data) // 2] ^= 0x01
    (root / where).write_bytes(bytes(data))
    cases.manifest.cache_clear()
    try:
        with pytest.raises(cases.CorruptFixture, match="sha256"):
            if where.endswith(".npz"):
                cases._load(
                    next(e for e in cases.manifest(root)["cases"] if e["file"] == where), root
                )
            else:
                cases.worked_example(root)
    finally:
        cases.manifest.cache_clear()


def test_npz_files_load_without_pickle():
    for entry in cases.manifest()["cases"]:
        case = cases.load_case(entry["id"])
        assert all(a.dtype != object for a in case.arrays.values())


def test_coverage_of_the_issue_list():
    """The fixtures cover what the spec promises: sizes, masks, dtypes and variants."""
    entries = cases.manifest()["cases"]
    att = [e for e in entries if e["kind"] == "attention"]
    shapes = [e["shape"] for e in att]
    assert any(s["T"] == 1 for s in shapes) and any(s["T"] == 7 for s in shapes)
    assert any(s["T"] != s["S"] for s in shapes) and any(s["D"] == 1 for s in shapes)
    assert any(s["E"] != s["D"] for s in shapes) and any(s["B"] > 1 and s["H"] > 1 for s in shapes)
    assert {e["mask"] for e in att} >= {"bool", "float"}
    assert any(e["options"]["is_causal"] and e["mask"] for e in att)
    assert any(e["options"]["scale"] not in (None, 1.0) for e in att)
    assert any(e["mask_block_rows"] for e in att)
    assert {e["dtype"] for e in att} == {"float64", "float32", "float16", "bfloat16"}
    assert any(e["options"]["causal_alignment"] == "bottom_right" for e in att)
    assert any(e["options"]["window"] for e in att) and any(e["options"]["softcap"] for e in att)
    assert any(s["K"] < s["H"] for s in shapes) and any(s["K"] == 1 for s in shapes)
    assert {e["kind"] for e in entries} >= {"mha", "gpt_block"}


def test_a_mismatch_names_the_field_and_both_values(tmp_path):
    arrays = cases.load_case("T7-S7-float64").arrays
    generate.write_npz(tmp_path / "a.npz", arrays)
    changed = dict(arrays, expected=arrays["expected"].copy())
    changed["expected"][0, 1, 2, 3] += 2.0**-50
    generate.write_npz(tmp_path / "b.npz", changed)
    (problem,) = _npz_differences(
        (tmp_path / "b.npz").read_bytes(), (tmp_path / "a.npz").read_bytes()
    )
    assert "'expected' at (0, 1, 2, 3)" in problem
    assert repr(changed["expected"][0, 1, 2, 3]) in problem
    assert repr(arrays["expected"][0, 1, 2, 3]) in problem
