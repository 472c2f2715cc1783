"""``python train.py``: the repository's entry point of :mod:`vit3.scripts.train` (installed:
``vit3-train``)."""

import sys

from vit3.scripts.train import main

if __name__ == "__main__":
    sys.exit(main())
