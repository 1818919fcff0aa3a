"""The test suite's layout: test files in folders named after the part of src/ they test, helpers at
tests/, and no two test files with the same name (pytest's default "prepend" import mode imports a
test file by its name alone, with no __init__.py files, so a second file of that name fails to collect)."""

from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
SRC = TESTS.parent / "src" / "lightning_roundpipe"
# Folders that test something other than one part of src/.
OTHER_FOLDERS = {"docs_and_setup", "benchmark_scripts", "options"}  # options: src/.../options/


def test_every_test_file_sits_in_a_folder():
    assert sorted(p.name for p in TESTS.glob("test_*.py")) == [], "move it into the folder of the part it tests"


def test_test_file_names_are_unique():
    names = Counter(p.name for p in TESTS.rglob("test_*.py"))
    assert [n for n, count in names.items() if count > 1] == []


def test_folders_are_parts_of_src():
    parts = {p.name for p in SRC.iterdir() if p.is_dir() and not p.name.startswith("_")}
    folders = {p.name for p in TESTS.iterdir() if p.is_dir() and not p.name.startswith((".", "_"))}
    assert folders - parts - OTHER_FOLDERS - {"lab"} == set()  # lab: the tests of src/roundpipe_lab
    assert not list(TESTS.rglob("__init__.py"))  # test modules keep being imported by their file name
