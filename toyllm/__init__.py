"""toyllm: a small, readable PyTorch framework for learning how LLM inference works.

    from toyllm import load_model, generate
    model, tokenizer = load_model("smollm2-135m")
    result = generate(model, tokenizer.encode_chat("What is the capital of France?"), 40,
                      eos_id=tokenizer.eos_id)
    print(tokenizer.decode(result.output_ids))
"""
from .cache import DynamicKVCache, StaticKVCache, make_cache
from .generation import GenerationResult, decode_step, generate, prefill, sample_next_token
from .model import PRESETS, ModelConfig, Transformer, build_model, get_config


def load_model(name: str = "tiny", attention="dense", seed: int = 0, weights: str = "fp32"):
    """(model, tokenizer) for a preset: "tiny", "bench" (random, seeded) or "smollm2-135m" (GGUF weights).

    weights: "fp32", "bf16", "fp16" or "int8" (see ``toyllm.quant``).
    """
    from .weights import load_model as _load

    return _load(name, attention=attention, seed=seed, weights=weights)


__all__ = ["ModelConfig", "PRESETS", "Transformer", "build_model", "get_config", "load_model",
           "DynamicKVCache", "StaticKVCache", "make_cache", "GenerationResult", "generate",
           "prefill", "decode_step", "sample_next_token"]
