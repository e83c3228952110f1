"""The trusted side of grading: which tests run, their pytest processes, what they report.

It starts the sandbox (``toyllm.grading.sandbox``) and never runs submitted code itself.

- ``grade``: ``grade`` and ``check``;
- ``selection``: which tests run; ``run``: one lesson's trusted pytest
  process, watched; ``standby``: such a process started ahead;
- ``plugin``: the pytest plugin (``--impl``, the markers, the grader's log);
- ``outcome``: its event log read into a status per test; ``report``: tables
  and Gradescope results;
- ``cli``: the command line (``python -m toyllm grade``, ``python -m toyllm.grading``);
- ``gradebook``: a class folder graded side by side into one CSV (``grade --class``);
- ``timing`` and ``class_timing``: how long grading takes.
"""
