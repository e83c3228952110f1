"""The exercises an engine's worker processes ran are known in the parent (a failed graded test names them).

Kept apart from tests/test_launch.py, whose tests run no exercise (it is marked ``library``).
"""
from __future__ import annotations

import pytest

from toyllm.launch import WorkerError, WorkerPool

try:  # tests/ is a plain folder that pytest puts on sys.path ...
    import workers_for_tests as W
except ImportError:  # ... or a package
    from tests import workers_for_tests as W


@pytest.mark.engine
@pytest.mark.timeout(90)
@pytest.mark.parametrize("fail", [False, True])
def test_what_the_workers_ran_is_recorded_in_the_parent(fail):
    """A failed test names the exercises the engine ran for it, also those its worker processes ran."""
    from toyllm import answers

    # Only an exercise that ran is recorded: an unwritten one (the student edition's stubs) names itself in its
    # own error instead.
    asked, again = {n for n in ("2.2", "3.1") if answers.written(n)}, {"8.4"} if answers.written("8.4") else set()
    answers.ran.clear()
    with WorkerPool(2, timeout_s=60) as pool:
        if fail:                                   # a failed task closes the pool: its record still arrives
            with pytest.raises(WorkerError, match="fails after asking"):
                pool.run(W.asks_for_exercise, (["2.2", "3.1"],), {"fail": True})
            assert answers.ran == asked
        else:
            assert pool.run(W.asks_for_exercise, (["2.2", "3.1"],)) == [0, 1]
            assert answers.ran == asked
            answers.ran.clear()
            pool.run(W.asks_for_exercise, (["8.4", "8.4"],))      # each task's own record, not the last one's too
            assert answers.ran == again
    answers.ran.clear()
