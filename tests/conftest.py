"""Shared fixtures. The SmolLM2 weights are read once per test session."""
import pytest
import torch

torch.set_grad_enabled(False)


@pytest.fixture(scope="session")
def smollm2():
    """(model, tokenizer) of the real SmolLM2-135M-Instruct."""
    from toyllm import load_model

    return load_model("smollm2-135m")
