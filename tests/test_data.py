"""The bundled corpus (jaxkv/data): every test, benchmark, notebook and README command reads its
text from the package, never from a folder beside the checkout."""

import subprocess
from pathlib import Path

import pytest

from jaxkv import data

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("book", data.BOOKS)
def test_each_bundled_novel_is_the_whole_book(book):
    text = data.austen(book)
    assert len(text) > 600_000 and "Austen" in text[:200]
    assert data.austen(book + ".txt") == text       # the file name works too
    assert data.read_text(data.PREFIX + book) == text


def test_read_text_takes_a_path_and_names_what_is_wrong(tmp_path):
    f = tmp_path / "t.txt"
    f.write_text("naïve ✓", encoding="utf-8")
    assert data.read_text(str(f)) == "naïve ✓"
    with pytest.raises(ValueError, match="book='persuasion' is not bundled.*emma"):
        data.read_text("austen:persuasion")
    with pytest.raises(ValueError, match=r"'nowhere\.txt' is neither a file nor a bundled text"):
        data.read_text("nowhere.txt")


def test_no_project_file_reads_a_folder_beside_the_checkout():
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.split()
    needles = ("../shared", "shared/data", '"shared" /', "/ \"shared\"", "/ 'shared'")
    offenders = [f for f in files if f != "tests/test_data.py" and (ROOT / f).is_file()
                 and any(n in (ROOT / f).read_text(encoding="utf-8", errors="ignore")
                         for n in needles)]
    assert not offenders
