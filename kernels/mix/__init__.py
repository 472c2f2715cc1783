"""The whole-mixer C++ op (``csrc/mix.cpp``) and its glue (``cpp.py``)."""
