"""Named models with their trainer and inference layouts, and the layout pairs of a refit."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

from jreshard.errors import IndivisibleError
from jreshard.models.deepseek import (
    deepseek_v3,
    deepseek_v3_inference,
    deepseek_v3_trainer,
    kimi_k2,
    kimi_k2_inference,
    kimi_k2_trainer,
)
from jreshard.models.llama3 import llama3_70b, llama3_70b_inference, llama3_70b_trainer
from jreshard.models.qwen3 import qwen3_235b, qwen3_235b_inference, qwen3_235b_trainer
from jreshard.models.table import Model, Parallelism
from jreshard.sharding.layout import Layout

__all__ = ["MODELS", "Recipe", "Refit", "refit"]


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Recipe:
    """A model and the parallel layouts its trainer and inference engine use at ``n`` GPUs."""

    model: Callable[[], Model]
    trainer: Callable[[int], Parallelism]
    inference: Callable[[int], Parallelism]
    gpu_multiple: int  # each side's GPU count must be a multiple of this


MODELS: dict[str, Recipe] = {
    "deepseek-v3": Recipe(
        model=deepseek_v3, trainer=deepseek_v3_trainer, inference=deepseek_v3_inference, gpu_multiple=128
    ),
    "kimi-k2": Recipe(model=kimi_k2, trainer=kimi_k2_trainer, inference=kimi_k2_inference, gpu_multiple=128),
    "qwen3-235b": Recipe(model=qwen3_235b, trainer=qwen3_235b_trainer, inference=qwen3_235b_inference, gpu_multiple=32),
    "llama3-70b": Recipe(model=llama3_70b, trainer=llama3_70b_trainer, inference=llama3_70b_inference, gpu_multiple=8),
}


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Refit:
    """A model's refit: trainer ranks ``0..n_train-1`` to inference ranks ``n_train..``.

    Attributes:
      model: the parameter table.
      trainer, inference: the two sides' parallel layouts.
      pairs: ``(source, destination)`` layout per parameter, in table order.
      names: the parameter names.
    """

    model: Model
    trainer: Parallelism
    inference: Parallelism
    pairs: tuple[tuple[Layout, Layout], ...]
    names: tuple[str, ...]


@functools.cache
def _model(name: str) -> Model:
    return MODELS[name].model()


def refit(name: str, n_train: int, n_infer: int) -> Refit:
    """The layout pairs of refitting model ``name`` from ``n_train`` trainer GPUs to ``n_infer`` inference GPUs.

    Args:
      name: a key of :data:`MODELS` ("deepseek-v3", "kimi-k2", "qwen3-235b", "llama3-70b").
      n_train: trainer GPUs (ranks ``0..n_train-1``).
      n_infer: inference GPUs (ranks ``n_train..n_train+n_infer-1``).

    Raises:
      ValueError: unknown ``name``; IndivisibleError: a GPU count the recipe cannot split.

    Example:
      >>> r = refit("llama3-70b", 128, 64)
      >>> len(r.pairs), r.trainer.name, r.inference.name
      (723, 'DP16 x FSDP8 (JAX)', 'TP8 x DP8')
    """
    if name not in MODELS:
        raise ValueError(f"refit: name={name!r} is not a known model; choose one of {sorted(MODELS)}")
    recipe = MODELS[name]
    for what, n in (("n_train", n_train), ("n_infer", n_infer)):
        if not isinstance(n, int) or n < recipe.gpu_multiple or n % recipe.gpu_multiple:
            raise IndivisibleError(
                f"refit({name!r}): {what}={n} must be a positive multiple of {recipe.gpu_multiple} "
                f"for this model's parallel layout"
            )
    model = _model(name)
    trainer, inference = recipe.trainer(n_train), recipe.inference(n_infer)
    pairs = tuple(
        (trainer.layout(p, model.layers, 0), inference.layout(p, model.layers, n_train)) for p in model.params
    )
    return Refit(
        model=model, trainer=trainer, inference=inference, pairs=pairs, names=tuple(p.name for p in model.params)
    )
