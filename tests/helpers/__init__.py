"""Test helpers, imported as ``helpers.<module>`` (``tests/`` is on pytest's ``pythonpath``)."""
