"""A wrong per-layer step is reported by its cause: the rank, the layer, the quantity and the student's line.

Each step here is the model answer with one classic mistake, run in the real
engine on three processes with uneven chunks (a mistake that only shows
beyond two ranks must show here).
"""
from __future__ import annotations

from pathlib import Path

import pytest

from toyllm.launch import WorkerError
from toyllm.parallel import parallel_prefill
from toyllm.utils import random_prompt

ROOT = Path(__file__).resolve().parent.parent


def _step_file(tmp_path: Path, lesson: str, old: str, new: str) -> Path:
    source = (ROOT / "solutions" / lesson).read_text()
    assert old in source, old
    path = tmp_path / lesson
    path.write_text(source.replace(old, new))
    return path


def _failure(path: Path, function: str, method: str) -> str:
    ids = random_prompt(40, 256, seed=3)
    with pytest.raises(WorkerError) as info:
        parallel_prefill("tiny", ids, method, 3, [20, 6, 14], step=f"{path}:{function}", warmup=0, timeout_s=60)
    return info.value.traceback.strip().splitlines()[-1]


@pytest.mark.engine
@pytest.mark.timeout(180)
def test_a_kvr_step_that_passes_on_only_its_own_keys_is_named_by_rank_layer_and_count(tmp_path):
    path = _step_file(tmp_path, "ex05_kv_runahead.py",
                      "    if prefix is not None:\n        k, v = torch.cat([prefix[0], k], dim=-2), "
                      "torch.cat([prefix[1], v], dim=-2)\n    chain.send(k, v)\n",
                      "    chain.send(k, v)\n    if prefix is not None:\n        k, v = torch.cat([prefix[0], k], "
                      "dim=-2), torch.cat([prefix[1], v], dim=-2)\n")
    last = _failure(path, "kvr_layer_blocking", "kvr")
    assert "rank 1, layer 0, kvr_layer_blocking (ex05_kv_runahead.py, line" in last, last
    assert "the keys sent to rank 2 have shape (1, 2, 6, 16)" in last, last
    assert "s_1 + c_1 = 20 + 6" in last and "the grown one" in last, last


@pytest.mark.engine
@pytest.mark.timeout(180)
def test_a_shape_error_inside_a_tsp_step_names_the_rank_layer_and_the_students_line(tmp_path):
    path = _step_file(tmp_path, "ex04_tsp.py", "out = layer.attend(q, k_all, v_all, pos.q_pos, k_pos, attention)",
                      "out = layer.attend(q, k_all, v_all, pos.q_pos, pos.q_pos, attention)")
    last = _failure(path, "tsp_layer", "tsp")
    assert "layer 0, tsp_layer (ex04_tsp.py, line" in last and "pos.q_pos, pos.q_pos, attention)" in last, last
    assert "k has 40 tokens and k_pos" in last, last
