"""The command-line programs: ``train``, ``eval`` and ``export``.

The repository's ``train.py`` / ``eval.py`` / ``export.py`` run them (``python train.py``, ``torchrun
train.py``); an installed package has them as ``vit3-train`` / ``vit3-eval`` / ``vit3-export`` and as
``python -m vit3.scripts.<name>``. Each module's ``main(argv)`` returns the exit code.
"""
