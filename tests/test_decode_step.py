"""The decode step seen by the profiler, and the torch.compile trial's clean fallback (tiny model, no timing asserted)."""
import torch

from toyllm.bench.decode import compile_trial, profile_decode_step
from toyllm.cache import make_cache
from toyllm.model import build_model


def test_a_decode_step_does_the_same_python_work_at_any_context_length():
    model = build_model("tiny")
    short, long = profile_decode_step(model, prompt_len=8, steps=2), profile_decode_step(model, prompt_len=400, steps=2)
    assert short["top_level_calls"] == long["top_level_calls"]          # nothing per cached token, nothing per step
    assert short["top_level_calls"] < 80 * model.config.n_layers          # about 70 per layer, with the head
    assert 0 < short["matmul_share"] < 1 and short["top"][0]["share"] > 0


def test_compile_trial_falls_back_cleanly_without_a_compiler(monkeypatch):
    model = build_model("tiny")
    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(0))
    before = model(ids)

    def no_compiler(*args, **kwargs):
        raise RuntimeError("no working C++ compiler found")

    monkeypatch.setattr(torch, "compile", no_compiler)
    result = compile_trial(model, prompt_len=8, steps=2, rounds=1)
    for way in ("whole", "parts"):
        assert result[way]["ok"] is False and "no working C++ compiler" in result[way]["reason"]
    assert all("qkv" not in layer.__dict__ and "finish" not in layer.__dict__ for layer in model.layers)
    assert torch.equal(model(ids), before)
    cache = make_cache("static", model.config, 16)
    assert torch.allclose(model(ids, cache=cache), before, atol=1e-6)
