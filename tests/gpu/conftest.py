"""The GPU tests: the model on CUDA against the CPU, and every parallel method on NCCL, one rank per GPU.

``make gpu-check`` runs them (then the CUDA timings of ``toyllm.gpu_check``);
docs/testing.md, "GPU check", says what they check and how to install the
CUDA build of PyTorch they need. Every test here is marked ``gpu``. Without
a CUDA GPU (the locked CPU build of PyTorch has no CUDA) each one is skipped
with the reason, so ``make test`` collects them harmlessly.
"""


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (the parallel methods two or more); "
                                       "make gpu-check runs these")

