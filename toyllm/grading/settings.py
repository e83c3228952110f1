"""Every environment variable that the grader and its sandbox hand each other, in one frozen object.

A grading crosses several processes: the grader (``python -m toyllm grade``),
one trusted pytest process per lesson (``grader.run``, started with
``-p toyllm.grading.grader.plugin``), the sandbox that runs the submission
(``sandbox.process``, ``sandbox.server``) and, for the parallel engine, its
workers. What one of them must tell the next travels in environment variables;
``Settings`` names them all, says who sets and who reads each, and is the one
way grading code reads and writes them::

    settings = Settings.from_env(os.environ)        # what this process was handed
    settings.lesson                                 # "3", or None when unset
    env = {**os.environ, **Settings(lesson="3", log=str(log)).to_env()}   # what a child is handed

Each field holds the variable's text as it is in the environment (``None``
when it is unset); the module that reads a variable also says what its text
means. ``Settings.variable("lesson")`` is the variable's name, for messages.

The first four variables belong to ``toyllm.course``, the seam below the
grader, which reads them itself (it imports nothing of toyllm), so their
names are defined there and only gathered here.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field

from ..course import ANSWERS_ENV, COURSE_ENV, IMPL_ENV, SANDBOX_ENV


def _variable(name: str):
    return field(default=None, metadata={"variable": name})


@dataclass(frozen=True)
class Settings:
    """The grading's environment variables, each ``None`` when unset (see the module's docstring)."""

    course: str | None = _variable(COURSE_ENV)
    """``TOYLLM_COURSE_DIR``: the course checkout (``exercises/``, ``tests/grading/``) when it is not found from
    the current folder. Set by the instructor, by the grader for its pytest processes (``grader.run``) and by
    the builder of stored references (``references``); read by ``toyllm.course.course_root``."""

    answers: str | None = _variable(ANSWERS_ENV)
    """``TOYLLM_ANSWERS``: the folder of model answers when it is not ``solutions/``. Set by whoever runs the
    framework against other answers (a test, an instructor); read by ``toyllm.answers``."""

    impl: str | None = _variable(IMPL_ENV)
    """``TOYLLM_IMPL``: whose exercises run: ``exercises`` (the default), ``solutions`` or a folder of
    ``exNN_*.py``. Set by the learner or instructor, by ``--impl`` (``grader.plugin``), by the grader for its
    pytest processes (``grader.run``) and by the sandbox for the submission's copy (``sandbox.process``);
    read by ``toyllm.course.resolve_impl``."""

    sandbox: str | None = _variable(SANDBOX_ENV)
    """``TOYLLM_GRADE_SANDBOX``: ``"1"`` in the grader's pytest processes: exercises run in the sandbox, never
    there. Set by ``grader.run``; read by ``toyllm.course.load_exercise``, ``sandbox.local`` and the graded
    tests' conftest."""

    fast: str | None = _variable("TOYLLM_FAST")
    """``TOYLLM_FAST``: the lessons' size switch (``"1"``: smaller experiments). Set by whoever runs the tests
    or the notebooks, and by the recording of references (``references``); handed on by the grader to its
    pytest processes (``grader.run``) and to the sandbox (``sandbox.process``); read by the notebooks."""

    log: str | None = _variable("TOYLLM_GRADE_LOG")
    """``TOYLLM_GRADE_LOG``: the file the pytest plugin appends one JSON line per event to; set, the pytest
    process is the grader's. Set by ``grader.run``; read by ``grader.plugin``."""

    lesson: str | None = _variable("TOYLLM_GRADE_LESSON")
    """``TOYLLM_GRADE_LESSON``: the lesson (an int) whose tests a grader's pytest process runs, the others
    left out. Set by ``grader.run``; read by ``grader.plugin``."""

    exercises: str | None = _variable("TOYLLM_GRADE_EXERCISES")
    """``TOYLLM_GRADE_EXERCISES``: if not empty, only these exercises' tests run (``"1.2,1.3"``). Set by
    ``grader.run``; read by ``grader.plugin``."""

    timeout: str | None = _variable("TOYLLM_GRADE_TIMEOUT")
    """``TOYLLM_GRADE_TIMEOUT``: seconds per test (the grader's ``--timeout``), also the longest a sandbox call
    may take outside a test. Set by ``grader.run``; read by ``sandbox.process``."""

    engine_limit: str | None = _variable("TOYLLM_GRADE_ENGINE_LIMIT")
    """``TOYLLM_GRADE_ENGINE_LIMIT``: seconds one run of the parallel engine in a graded test may take before it
    fails as a deadlock (unset: 10). Set by the instructor (a slow machine) or a test; read by the graded tests'
    conftest."""

    memory_mb: str | None = _variable("TOYLLM_GRADE_MEMORY_MB")
    """``TOYLLM_GRADE_MEMORY_MB``: the sandbox's address-space limit in MiB (the grader's ``--memory-mb``).
    Set by ``grader.run``; read by ``sandbox.process``."""

    user: str | None = _variable("TOYLLM_SANDBOX_USER")
    """``TOYLLM_SANDBOX_USER``: who runs the submission when the grader is root (else a fresh user id per
    sandbox). Set by the instructor; read by ``sandbox.process``."""

    hide: str | None = _variable("TOYLLM_GRADE_HIDE")
    """``TOYLLM_GRADE_HIDE``: folders the submission must not see (``os.pathsep``-separated): the graded
    tests, the hidden tests, the model answers. Set by ``grader.run``; read by ``sandbox.process``."""

    scratch: str | None = _variable("TOYLLM_GRADE_SCRATCH")
    """``TOYLLM_GRADE_SCRATCH``: the grader's private folder, where the sandboxes' scratch folders go. Set by
    ``grader.run``; read by ``sandbox.process``."""

    step: str | None = _variable("TOYLLM_GRADE_STEP")
    """``TOYLLM_GRADE_STEP``: what ``harness.guarded_step`` runs in the parallel engine's workers, and under
    which rules (JSON: the step, the exercise, what it may not call). Set by ``sandbox.harness`` for the
    workers it starts; read by ``sandbox.harness`` in each worker."""

    trace: str | None = _variable("TOYLLM_GRADE_TRACE")
    """``TOYLLM_GRADE_TRACE``: the folder where ``harness.traced_step`` leaves what each rank attended over.
    Set and read by ``sandbox.harness`` (the workers write, the sandbox reads)."""

    verdicts: str | None = _variable("TOYLLM_GRADE_VERDICTS")
    """``TOYLLM_GRADE_VERDICTS``: what the earlier lessons of this grading showed of their exercises, as JSON
    (``{"2.1": true, "2.2": false}``): true, it failed a graded test of its own that ran no other exercise;
    false, every graded test of it passed. A failed test's note about another exercise needs no grading of
    one listed. Set by ``grader.run``; read by the graded tests' conftest (``plugin.verdicts_before``)."""

    neighbour: str | None = _variable("TOYLLM_GRADE_NEIGHBOUR")
    """``TOYLLM_GRADE_NEIGHBOUR``: set (``"1"``) while another exercise is graded only for a failure's note
    (``expect.ran_also``). Set by ``expect``; read by the graded tests' conftest."""

    seed: str | None = _variable("TOYLLM_GRADE_SEED")
    """``TOYLLM_GRADE_SEED``: the seed of the graded tests' drawn cases (unset: the stored ones). Set by the
    instructor and by the recording of references (``references``); read by the graded tests' conftest and by
    ``references``."""

    record: str | None = _variable("TOYLLM_RECORD_EXPECTED")
    """``TOYLLM_RECORD_EXPECTED``: a folder: every reference's value is recorded there. Set by the builder of
    the student edition (``references.write_expected_values``); read by ``references``."""

    @classmethod
    def variable(cls, name: str) -> str:
        """The environment variable of field ``name`` (``"lesson"`` -> ``"TOYLLM_GRADE_LESSON"``)."""
        return _VARIABLES[name]

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Settings:
        """The settings that ``env`` (``os.environ``, say) holds; a variable it lacks is ``None``."""
        return cls(**{name: env.get(variable) for name, variable in _VARIABLES.items()})

    def to_env(self) -> dict[str, str]:
        """``{variable: text}`` of the fields that are set: what to add to a child process's environment."""
        return {variable: getattr(self, name) for name, variable in _VARIABLES.items()
                if getattr(self, name) is not None}

    @staticmethod
    def trusted_environment(env: Mapping[str, str]) -> dict[str, str]:
        """What of ``env`` (the grading process's, ``os.environ``) the grader's own processes start with: the
        grading's variables and ``PASSED_ON``, nothing else. The trusted pytest processes, the template they
        are copied from and the zygote the sandboxes are copied from all start so, since a copy keeps its
        parent's memory: a token in the instructor's shell must not be in a page a submission can read."""
        return {k: v for k, v in env.items() if k in PASSED_ON or k in _VARIABLES.values()}


_VARIABLES = {f.name: f.metadata["variable"] for f in dataclasses.fields(Settings)}

# The rest of the grading process's environment that its own processes keep (``trusted_environment``): where
# programs, libraries and temporary files are, the language, the Python that runs, and how many threads PyTorch's
# OpenMP takes and how they wait.
PASSED_ON = frozenset({"PATH", "HOME", "TMPDIR", "LANG", "LC_ALL", "LC_CTYPE", "LD_LIBRARY_PATH", "PYTHONPATH",
                       "VIRTUAL_ENV", "OMP_NUM_THREADS", "OMP_WAIT_POLICY", "MKL_NUM_THREADS",
                       "MALLOC_MMAP_MAX_", "MALLOC_TRIM_THRESHOLD_"})
