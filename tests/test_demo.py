"""The demo checks the exercises its timed sections run before it times anything (the student edition)."""
from types import SimpleNamespace

import pytest

import toyllm
import toyllm.bench
import toyllm.demo
from toyllm import answers
from toyllm.cli import main


@pytest.mark.timeout(60)
def test_the_demo_names_each_missing_exercise_up_front_and_runs_what_needs_none(monkeypatch, capsys):
    """With Exercise 2.2 unwritten: one line naming it before the chat, no decode-speed timing, the rest runs."""
    ran = []

    def require(*numbers):
        if "2.2" in numbers:
            raise answers.ExerciseNotWritten("The KV-cache size needs Exercise 2.2: write kv_cache_bytes in "
                                             "exercises/ex02_kv_cache.py")

    def part(name):
        return lambda *args, **kwargs: ran.append(name)

    def chat(*args, **kwargs):
        ran.append("chat")
        return SimpleNamespace(ttft_s=0.1, tpot_s=0.01)

    verdict = SimpleNamespace(sentence=lambda *names: "about the same")
    monkeypatch.setattr(answers, "require", require)
    monkeypatch.setattr(toyllm.bench, "ensure_resident_heap", lambda argv: None)
    monkeypatch.setattr(toyllm, "load_model", lambda *args, **kwargs: (None, SimpleNamespace(
        encode_chat=lambda text: [1, 2], eos_id=0)))
    monkeypatch.setattr(toyllm, "generate", chat)
    monkeypatch.setattr(toyllm.demo, "demo_decode_speed", part("decode speed"))
    monkeypatch.setattr(toyllm.bench, "naive_vs_cached",
                        lambda *args, **kwargs: ran.append("naive vs cached") or {"verdict": verdict, "identical": True})
    monkeypatch.setattr(toyllm.demo, "demo_prefill", part("parallel prefill"))

    assert main(["demo"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == ("not yet: The KV-cache size needs Exercise 2.2: write kv_cache_bytes in "
                      "exercises/ex02_kv_cache.py; until then the demo leaves out the decode speed")
    assert out[1].startswith("== SmolLM2")                  # the missing exercise is named before anything runs
    assert ran == ["chat", "naive vs cached", "parallel prefill"]
    assert "(not yet: needs Exercise 2.2; it unlocks once you have written it)" in out
