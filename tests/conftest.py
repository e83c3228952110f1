"""Shared fixtures. The SmolLM2 weights are read once per test session."""
import pytest
import torch

torch.set_grad_enabled(False)


@pytest.fixture(scope="session")
def smollm2_gguf():
    """Path of the SmolLM2 GGUF file; the test is skipped (naming the install command) when it is missing."""
    from toyllm.weights import find_smollm2_gguf

    try:
        return find_smollm2_gguf()
    except FileNotFoundError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def smollm2():
    """(model, tokenizer) of the real SmolLM2-135M-Instruct."""
    from toyllm import load_model

    return load_model("smollm2-135m")
