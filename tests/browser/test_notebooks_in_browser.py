"""Every lesson notebook, run in JupyterLab in a real (headless) Chromium, as a learner sees it.

nbclient (tests/test_notebooks.py) proves the kernel side; this proves the page:
for each ``notebooks/NN_*.ipynb`` the test opens it in JupyterLab, clicks
Run > Run All Cells, waits for the kernel, and then reads the rendered page:

- every code cell ran (its prompt shows an execution count);
- no error output, and no traceback printed on stderr;
- every cell that draws a plot (calls ``plt.…`` or a ``viz.plot_*`` helper) shows
  at least one decoded image;
- every widget rendered: no "Error displaying widget" or JavaScript error
  view, none stuck on "Loading widget...", none shown as its text fallback
  (``VBox(children=...)``, what a page without the widget renderer shows);
- moving the first slider of the lesson's first widget with the mouse changes
  what the widget shows (its text or its figure), i.e. the kernel answered;
- every ``check("N.M")`` of the lesson printed full marks (the lessons run the model answers);
- every printed verdict ("KVR 0.41 s [0.40-0.43 s] vs TSP 0.50 s [...]: KVR is
  1.22x faster") follows from the runs it prints (``tests/verdict_text.py``);
  the lessons that time things through their own cells run beside processes
  spinning on every core but one (on 2 cores, one), so that their verdicts are
  read under noise.

A fixture notebook with deliberately broken outputs proves the check fails
when it should. Screenshots of each lesson's first widget, before and after
the slider moved, land in ``build/screenshots/`` (git-ignored).

Run it alone with ``make test-browser`` (or ``pytest -m browser``).
"""
from __future__ import annotations

import contextlib
import re
import time
from pathlib import Path

import pytest

from toyllm import answers

try:
    from tests.verdict_text import (HOG_LESSONS, TIMING_LESSONS, check_problems, count_verdicts, cpu_hog,
                                    verdict_problems)
except ImportError:                          # tests/ itself on sys.path
    from verdict_text import HOG_LESSONS, TIMING_LESSONS, check_problems, count_verdicts, cpu_hog, verdict_problems

REPO_ROOT = Path(__file__).resolve().parents[2]
LESSONS = sorted((REPO_ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
BROKEN = Path(__file__).parent / "fixtures" / "broken_outputs.ipynb"
SCREENSHOTS = REPO_ROOT / "build" / "screenshots"

OPEN_TIMEOUT_S = 120      # page loaded and kernel idle
RUN_TIMEOUT_S = 600      # Run All Cells of one lesson, TOYLLM_FAST=1
SETTLE_TIMEOUT_S = 30     # widgets leave "Loading widget..."
SLIDER_TIMEOUT_S = 60     # the kernel redraws a widget after the slider moved
POLL_S = 0.5

STDERR_MIME = "application/vnd.jupyter.stderr"
PLOT_CALL = re.compile(r"\b(?:plt\.(?:subplots|figure|plot|imshow|bar|barh|hist|scatter)|viz\.plot_\w+)\(")
# the text fallback of a widget (what a page without the widget renderer shows), e.g. "VBox(children=(...))"
WIDGET_REPR = re.compile(r"(?:[A-Z]\w*Box|\w+Slider|Output|Tab|Accordion|Dropdown|HTML|Label)\((?:children|value|layout|outputs)=")

pytestmark = [pytest.mark.browser, pytest.mark.slow]

# The prompts of the code cells ("[ ]:", "[*]:", "[3]:"), read without forcing a layout of the page:
# polled while the kernel works, it must cost the browser next to nothing.
PROMPTS_JS = """
return Array.from(document.querySelectorAll('.jp-NotebookPanel:not(.lm-mod-hidden) .jp-CodeCell .jp-InputPrompt'))
  .map(p => p.textContent.trim());
"""

# One entry per code cell of the notebook on screen: its prompt and its outputs as rendered (nested
# ones, inside an Output widget, included). A widget's output area is itself marked .jupyter-widgets
# (when it failed) or holds the widget's view, marked .jupyter-widgets; it has no data-mime-type.
READ_PAGE_JS = """
const panel = document.querySelector('.jp-NotebookPanel:not(.lm-mod-hidden)');
if (!panel) return null;
return Array.from(panel.querySelectorAll('.jp-Notebook .jp-Cell.jp-CodeCell')).map(cell => ({
  prompt: (cell.querySelector('.jp-InputPrompt') || {textContent: ''}).textContent.trim(),
  outputs: Array.from(cell.querySelectorAll('.jp-OutputArea-output')).map(out => ({
    mime: out.getAttribute('data-mime-type') || '',
    text: out.textContent.slice(0, 5000),
    images: Array.from(out.querySelectorAll('img')).filter(i => i.complete && i.naturalWidth > 0).length,
    widget: out.matches('.jupyter-widgets') || out.querySelector(':scope > .jupyter-widgets') !== null,
    widget_error: out.querySelector('.jupyter-widgets-error-widget') !== null,
  })),
}));
"""

# What a widget shows apart from its sliders (whose own readouts change with them): text and images.
WIDGET_FACE_JS = """
const copy = arguments[0].cloneNode(true);
copy.querySelectorAll('.widget-slider').forEach(s => s.remove());
return copy.textContent + Array.from(copy.querySelectorAll('img')).map(i => i.src).join('');
"""

# Whether every image inside a widget has finished loading and decoding (a redrawn figure is a new <img>).
IMAGES_DECODED_JS = """
return Array.from(arguments[0].querySelectorAll('img')).every(i => i.complete && i.naturalWidth > 0);
"""


# --------------------------------------------------------------------------- the check

def find_problems(cells: list[dict], sources: list[str]) -> list[str]:
    """What is wrong on a rendered notebook page, one line per problem (empty: all good).

    ``cells`` is READ_PAGE_JS's answer (code cells in page order), ``sources`` the
    code cells' sources from the notebook file, in the same order.
    """
    if len(cells) != len(sources):
        return [f"the page shows {len(cells)} code cells, the notebook has {len(sources)}"]
    problems = []
    for n, (cell, source) in enumerate(zip(cells, sources)):
        where = f"code cell {n} ({source.strip().splitlines()[0][:60] if source.strip() else 'empty'!r})"
        if not re.fullmatch(r"\[\d+\]:", cell["prompt"]):
            problems.append(f"{where}: did not run (prompt {cell['prompt']!r})")
        outputs = cell["outputs"]
        for out in outputs:
            text = out["text"].strip()
            if out["mime"] == STDERR_MIME and "Traceback" in text:
                problems.append(f"{where}: error output: {text[:300]!r}")
            if out["widget_error"] or "Error displaying widget" in text:
                problems.append(f"{where}: widget failed: {text[:120]!r}")
            elif out["widget"] and "Loading widget" in text:
                problems.append(f"{where}: widget never rendered ({text[:80]!r})")
            if out["mime"] == "text/plain" and WIDGET_REPR.match(text):
                problems.append(f"{where}: a widget shown as text, not rendered: {text[:80]!r}")
            problems += [f"{where}: {problem}" for problem in verdict_problems(text)]
        if PLOT_CALL.search(source) and not any(out["images"] for out in outputs):
            problems.append(f"{where}: draws a plot but the page shows no image")
        problems += [f"{where}: {problem}" for problem in check_problems(source, "\n".join(o["text"] for o in outputs))]
    return problems


# --------------------------------------------------------------------------- driving the page

def wait_for(what: str, condition, timeout_s: float, poll_s: float = POLL_S):
    """condition()'s first truthy answer, polled every poll_s seconds; TimeoutError naming ``what`` after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while True:
        answer = condition()
        if answer:
            return answer
        if time.monotonic() > deadline:
            raise TimeoutError(f"gave up after {timeout_s} s waiting for {what}")
        time.sleep(poll_s)


def open_notebook(driver, lab, name: str) -> None:
    """Open ``name`` in a workspace of its own (no other tab open) and wait until its kernel is idle."""
    from selenium.webdriver.common.by import By

    route = ("lab", "workspaces", Path(name).stem, "tree", name)   # JupyterLab: a named workspace, this file open
    driver.get(lab.url("/".join(route)))

    def ready():
        kernels = [s["kernel"] for s in lab.api("sessions") or [] if s["path"] == name and s.get("kernel")]
        return (driver.find_elements(By.CSS_SELECTOR, ".jp-NotebookPanel .jp-CodeCell")
                and not driver.find_elements(By.CSS_SELECTOR, ".jp-Dialog")
                and kernels and kernels[0]["execution_state"] == "idle")

    wait_for(f"{name} to open with an idle kernel and no dialog", ready, OPEN_TIMEOUT_S)


def run_all_cells(driver, name: str) -> list[dict]:
    """Run > Run All Cells, as a learner clicks it; returns the page once no cell is queued or running."""
    from selenium.webdriver.common.by import By

    driver.find_element(By.XPATH, "//li[contains(@class, 'lm-MenuBar-item')][normalize-space()='Run']").click()
    wait_for("the Run menu", lambda: driver.find_elements(
        By.CSS_SELECTOR, ".lm-Menu-item[data-command='runmenu:run-all']"), 10)[0].click()

    def finished():
        prompts = driver.execute_script(PROMPTS_JS)
        return any(re.search(r"\d|\*", p) for p in prompts) and not any("*" in p for p in prompts)

    wait_for(f"Run All Cells of {name} to finish", finished, RUN_TIMEOUT_S)

    def settled():
        cells = driver.execute_script(READ_PAGE_JS)
        loading = any("Loading widget" in o["text"] for c in cells for o in c["outputs"])
        return None if loading else cells

    try:
        return wait_for("the widgets to render", settled, SETTLE_TIMEOUT_S)
    except TimeoutError:
        return driver.execute_script(READ_PAGE_JS)   # find_problems names the stuck widgets


def code_sources(path: Path) -> list[str]:
    import nbformat      # here, not at the top: its import costs each collecting process ~1 s

    return [c.source for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code"]


def move_first_slider(driver, name: str) -> None:
    """Drag the first slider of the first widget that has one; wait until the widget shows something new.

    Screenshots of that widget before and after go to build/screenshots/.
    """
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By

    widgets = driver.find_elements(By.CSS_SELECTOR, ".jp-OutputArea-output:has(> .jupyter-widgets .noUi-handle)")
    assert widgets, f"{name}: no widget with a slider on the page"
    widget = widgets[0]
    driver.execute_script("arguments[0].scrollIntoView({block: 'center'})", widget)
    stem = Path(name).stem
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    widget.screenshot(str(SCREENSHOTS / f"{stem}_widget.png"))
    face = driver.execute_script(WIDGET_FACE_JS, widget)

    slider = widget.find_element(By.CSS_SELECTOR, ".widget-slider")
    track = slider.find_element(By.CSS_SELECTOR, ".noUi-target")
    handle = track.find_element(By.CSS_SELECTOR, ".noUi-handle")
    readout = slider.find_element(By.CSS_SELECTOR, ".widget-readout").text
    # drag a fifth of the track towards its middle, so the value moves whatever it started at
    middle = track.rect["x"] + track.rect["width"] / 2
    left_half = handle.rect["x"] + handle.rect["width"] / 2 < middle
    step = int(track.rect["width"] / 5) * (1 if left_half else -1)
    ActionChains(driver).click_and_hold(handle).move_by_offset(step // 2, 0).move_by_offset(step - step // 2, 0) \
        .release().perform()

    wait_for(f"{name}: the slider (at {readout}) to move under the mouse",
             lambda: slider.find_element(By.CSS_SELECTOR, ".widget-readout").text != readout, 10)
    wait_for(f"{name}: the widget to show new numbers or a new figure after its slider moved",
             lambda: driver.execute_script(WIDGET_FACE_JS, widget) != face, SLIDER_TIMEOUT_S)
    wait_for(f"{name}: the widget's new figure to be decoded", lambda: driver.execute_script(IMAGES_DECODED_JS, widget),
             SETTLE_TIMEOUT_S)   # before the picture
    widget.screenshot(str(SCREENSHOTS / f"{stem}_widget_moved.png"))


# --------------------------------------------------------------------------- tests

@pytest.mark.timeout(300)
def test_the_check_flags_broken_outputs(lab, browser, copy_into_lab):
    """The fixture's cells are broken one way each; the page check must name every one of them."""
    name = copy_into_lab(BROKEN)
    try:
        open_notebook(browser, lab, name)
        cells = run_all_cells(browser, name)
        problems = find_problems(cells, code_sources(BROKEN))
    finally:
        lab.shutdown_kernels(wait=False)      # the next lesson's page loads while this kernel ends
    flagged = {int(re.match(r"code cell (\d+)", p)[1]) for p in problems}
    text = "\n".join(problems)
    assert flagged == {1, 2, 3, 4, 5, 6, 7, 8}, text       # code cell 0 is a working widget
    assert re.search(r"code cell 1 .*widget failed: 'Error displaying widget: model not found'", text), text
    assert re.search(r"code cell 2 .*widget failed", text), text
    assert re.search(r"code cell 3 .*a widget shown as text", text), text
    assert re.search(r"code cell 4 .*error output: .*Traceback", text), text
    assert re.search(r"code cell 5 .*draws a plot but the page shows no image", text), text
    assert re.search(r"code cell 6 .*the printed runs do not support the verdict", text), text
    assert re.search(r"code cell 7 .*error output", text), text
    assert re.search(r"code cell 8 .*did not run", text), text   # Run All stops at the error


@pytest.mark.needs(*sorted(answers.answer_marks()))    # the lessons run the exercises the framework is built on
@pytest.mark.timeout(RUN_TIMEOUT_S + 300)
@pytest.mark.parametrize("path", LESSONS, ids=[p.stem for p in LESSONS])
def test_lesson_runs_and_renders_in_jupyterlab(path, lab, browser, copy_into_lab):
    name = copy_into_lab(path)
    try:
        open_notebook(browser, lab, name)
        start = time.perf_counter()
        busy = path.stem in HOG_LESSONS                # its timings run beside a CPU hog: verdicts under noise
        with cpu_hog() if busy else contextlib.nullcontext():
            cells = run_all_cells(browser, name)
        print(f"{name}: Run All Cells took {time.perf_counter() - start:.0f} s in the browser"
              f"{' beside a CPU hog' if busy else ''}")
        problems = find_problems(cells, code_sources(path))
        assert not problems, f"{name} in JupyterLab:\n" + "\n".join(problems)
        if path.stem in TIMING_LESSONS:                # the verdict check above had something to check
            assert count_verdicts("\n".join(o["text"] for c in cells for o in c["outputs"])), name
        move_first_slider(browser, name)   # fails (TimeoutError) unless the slider moves and the widget redraws
    except BaseException:
        SCREENSHOTS.mkdir(parents=True, exist_ok=True)
        browser.save_screenshot(str(SCREENSHOTS / f"{path.stem}_failure.png"))
        raise
    finally:
        lab.shutdown_kernels(wait=False)      # the next lesson's page loads while this kernel ends
