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


@functools.lru_cache(maxsize=2)
def _first_layers(spec: FirstLayers):
    model = load_model(spec.name, attention=spec.attention, seed=spec.seed)[0]    # a model of its own to cut
    if spec.layers > len(model.layers):
        raise ValueError(f"{spec.name} has {len(model.layers)} layers, not {spec.layers}")
    model.layers = torch.nn.ModuleList(model.layers[:spec.layers])
    model.config = spec.config
    return model
