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
    monkeypatch.setattr(toyllm.demo, "demo_fast_path", part("fast path"))

    assert main(["demo"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == ("not yet: The KV-cache size needs Exercise 2.2: write kv_cache_bytes in "
                      "exercises/ex02_kv_cache.py; until then the demo leaves out the decode speed")
    assert out[1].startswith("== SmolLM2")                  # the missing exercise is named before anything runs
    assert ran == ["chat", "fast path", "naive vs cached", "parallel prefill"]
    assert "(not yet: needs Exercise 2.2; it unlocks once you have written it)" in out


def test_the_fast_path_says_how_its_step_was_made_and_times_it_beside_fp32_eager(monkeypatch, tmp_path):
    """With the tiny model for SmolLM2 and a stand-in for the compiler (it runs the eager function)."""
    import io

    from toyllm import compile_cache
    from toyllm.compiled import CompiledDecoder

    def build(self):
        self._compiled = self._forward
        self.report = compile_cache.CompileReport("loaded", 2.0, "ahead", True, tmp_path / "step-x")
        return self.report

    monkeypatch.setenv(compile_cache.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(CompiledDecoder, "build", build)
    tiny = toyllm.load_model("tiny")[1]
    monkeypatch.setattr(tiny, "encode_chat", tiny.encode, raising=False)
    monkeypatch.setattr(toyllm, "load_model", lambda name, weights="fp32": (toyllm.weights.load_model(
        "tiny", weights=weights)[0], tiny))
    out = io.StringIO()
    data = toyllm.demo.demo_fast_path(rounds=5, new_tokens=4, answer_tokens=4, out=out)
    lines = out.getvalue().splitlines()
    assert lines[1] == ("  decode step compiled ahead of time (AOTInductor): loaded from the cache in 2.0 s "
                        f"({tmp_path / 'step-x'})")
    assert lines[2].startswith("  int4, compiled ahead: ") and "fp32 eager:" in lines[2] and "MISSES Paris" in lines[2]
    assert lines[3].startswith("  per token, int4, compiled ahead ") and "vs fp32 eager" in lines[3]
    assert len(data["fast_runs_s"]) == len(data["eager_runs_s"]) == 5 and not data["paris"]
