"""Writes the parts of the docs that the code defines: docs/mixer.md's table of inner models (registry).

python docs/generate.py          # rewrite them in place
python docs/generate.py --check  # exit 1 naming each page that is not current (tests/test_docs.py asks too)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from vit3.layers.inner_models import registered_inner_models

DOCS = Path(__file__).resolve().parent
BEGIN = (
    "<!-- inner models: written by `python docs/generate.py` from the registry; edit the registrations -->"
)
END = "<!-- end of the inner models -->"


def inner_model_table() -> str:
    """The Markdown table of every registered inner model: name, formula, ``inner_bias``, grid.

    Raises:
        ValueError: a registered model has no formula.
    """
    rows = [
        "| name | v̂ from the keys k | takes `inner_bias` | over the grid (no RoPE, no `inner_norm`) |",
        "| --- | --- | --- | --- |",
    ]
    for info in registered_inner_models():
        if not info.formula:
            raise ValueError(
                f"inner model {info.name!r} has no formula: register_inner_model({info.name!r}, formula=...)"
            )
        bias, grid = ("yes" if flag else "" for flag in (info.cls.takes_bias, info.cls.grid_model))
        rows.append(f"| `{info.name}` | {info.formula} | {bias} | {grid} |")
    return "\n".join(rows)


def written(page: Path) -> str:
    """``page``'s text with its generated part as the code defines it now.

    Raises:
        ValueError: the page lacks one of the markers, or a model has no formula.
    """
    lines = page.read_text().splitlines(keepends=True)
    stripped = [line.rstrip("\n") for line in lines]
    if stripped.count(BEGIN) != 1 or stripped.count(END) != 1 or stripped.index(BEGIN) > stripped.index(END):
        raise ValueError(f"{page}: needs the line {BEGIN!r} once, and after it the line {END!r} once")
    begin, end = stripped.index(BEGIN), stripped.index(END)
    return "".join([*lines[: begin + 1], f"\n{inner_model_table()}\n\n", *lines[end:]])


def stale_pages(docs: Path = DOCS) -> dict[Path, str]:
    """The pages under ``docs`` whose generated part is not what the code defines now, each with its text
    as the code defines it."""
    pages = {page: written(page) for page in [docs / "mixer.md"]}
    return {page: text for page, text in pages.items() if page.read_text() != text}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--check", action="store_true", help="change nothing; exit 1 if a page is not current"
    )
    args = parser.parse_args(argv)
    stale = stale_pages()
    for page, text in stale.items():
        if args.check:
            print(f"{page}: not current; run `python docs/generate.py`", file=sys.stderr)
        else:
            page.write_text(text)
            print(f"wrote {page}")
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
