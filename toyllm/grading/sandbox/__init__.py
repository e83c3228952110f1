"""The untrusted side of grading and its boundary: where a submission runs, and what crosses to it and back.

Nothing here imports the grader (``toyllm.grading.grader``); the grader imports this.

- ``process``: the submission's own process (``Sandbox``), the user it runs as,
  its limits, and the proxy that ``load_exercise`` returns inside a grading;
- ``launcher``: what the sandbox starts in (a fresh user id, namespaces,
  closed folders), before ``server`` serves the calls;
- ``server``: the sandbox process itself: it loads the submission and runs
  each call sent to it;
- ``wire``: what crosses the socket, both ways, and its limits;
- ``guard``: the rules a submitted call runs under (independence, one
  exercise at a time);
- ``local``: the same rules in this process (a plain pytest run), and
  ``sandboxed``;
- ``harness``: trusted helpers that graded tests run next to the submission;
  ``counted``: the evaluation counter they hand it;
- ``submission``: a submission's files read, within bounds.
"""
