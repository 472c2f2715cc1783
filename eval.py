"""``python eval.py``: the repository's entry point of :mod:`vit3.scripts.eval` (installed: ``vit3-eval``)."""

import sys

from vit3.scripts.eval import main

if __name__ == "__main__":
    sys.exit(main())
