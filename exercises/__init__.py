"""The course's graded exercises, one module per lesson (``ex01_naive_generation``, ...).

``solutions/`` holds the model answers and ``exercises/`` the same functions
with their bodies replaced by stubs (generated with ``python -m
toyllm.grading sync``). Don't import either folder directly: call
``toyllm.grading.load_exercise("ex01")``, which returns the implementation
chosen by ``TOYLLM_IMPL`` (``exercises`` by default, ``solutions``, or a
folder of your own).
"""
