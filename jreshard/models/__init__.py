"""Parameter tables of real models, with the layouts trainers and inference engines give them.

DeepSeek-V3, Kimi-K2, Qwen3-235B-A22B and Llama-3-70B, from their public
configurations; see :mod:`jreshard.models.table` for how roles become specs.
"""

from jreshard.models.deepseek import deepseek_v3 as deepseek_v3
from jreshard.models.deepseek import kimi_k2 as kimi_k2
from jreshard.models.llama3 import llama3_70b as llama3_70b
from jreshard.models.qwen3 import qwen3_235b as qwen3_235b
from jreshard.models.recipes import MODELS as MODELS
from jreshard.models.recipes import Recipe as Recipe
from jreshard.models.recipes import Refit as Refit
from jreshard.models.recipes import refit as refit
from jreshard.models.table import Model as Model
from jreshard.models.table import Parallelism as Parallelism
from jreshard.models.table import Param as Param
from jreshard.models.table import Role as Role
from jreshard.models.table import refit_topology as refit_topology

__all__ = [
    "MODELS",
    "Model",
    "Param",
    "Parallelism",
    "Recipe",
    "Refit",
    "Role",
    "deepseek_v3",
    "kimi_k2",
    "llama3_70b",
    "qwen3_235b",
    "refit",
    "refit_topology",
]
