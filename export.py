"""``python export.py``: the repository's entry point of :mod:`vit3.scripts.export` (installed:
``vit3-export``)."""

import sys

from vit3.scripts.export import main

if __name__ == "__main__":
    sys.exit(main())
