"""A pretrained model cut to its first few blocks, as a ``ModelSpec`` the engine's workers can rebuild.

Every block runs the same code, so a check of what depends on the context's length (positions up to the last
one, where each rank's chunk starts, the attention kernel over long spans) holds for the whole stack when it
holds for a few blocks, at a fraction of the work. Workers rebuild a spec by unpickling it, so the class lives
in a module of its own that they import by name.
"""
import functools
from dataclasses import dataclass

import torch

from toyllm import load_model
from toyllm.parallel import ModelSpec


@dataclass(frozen=True)
class FirstLayers(ModelSpec):
    """``name``'s real weights, the first ``layers`` blocks of its stack."""

    layers: int = 4

    @property
    def config(self):
        return super().config.with_(n_layers=self.layers)

    def build(self):
        return _first_layers(self)


def first_blocks(model, layers: int):
    """``model`` itself, cut to the first ``layers`` blocks of its stack (its config says so too)."""
    if layers > len(model.layers):
        raise ValueError(f"the model has {len(model.layers)} layers, not {layers}")
    model.layers = torch.nn.ModuleList(model.layers[:layers])
    model.config = model.config.with_(n_layers=layers)
    return model


@functools.lru_cache(maxsize=2)
def _first_layers(spec: FirstLayers):
    model = load_model(spec.name, attention=spec.attention, seed=spec.seed)[0]    # a model of its own to cut
    return first_blocks(model, spec.layers)
