"""SPEC §11.2: fixtures regenerate byte for byte, and a corrupted file is refused."""

from __future__ import annotations

import json
import shutil

import pytest

from conformance import cases
from fixtures import generate

pytestmark = pytest.mark.clause("11.2")


def test_regenerating_reproduces_identical_files(tmp_path):
    generate.generate(tmp_path)
    committed = json.loads((cases.FIXTURES / "manifest.json").read_text())
    regenerated = json.loads((tmp_path / "manifest.json").read_text())
    assert regenerated == committed, "manifest.json differs from a fresh regeneration"
    for entry in committed["cases"] + [committed["worked_example"]]:
        fresh = (tmp_path / entry["file"]).read_bytes()
        assert fresh == (cases.FIXTURES / entry["file"]).read_bytes(), (
            f"{entry['file']} differs from a fresh regeneration"
        )
        assert generate.sha256(tmp_path / entry["file"]) == entry["sha256"]


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
