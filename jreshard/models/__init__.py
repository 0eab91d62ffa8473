"""Parameter tables of real models, with the layouts trainers and inference engines give them.

DeepSeek-V3, Kimi-K2, Qwen3-235B-A22B and Llama-3-70B, from their public
configurations; see :mod:`jreshard.models.table` for how roles become specs.
Any Llama, Qwen3, Qwen3-MoE or DeepSeek-V3 ``config.json`` (:func:`read_hf_config`);
Megatron parallelism mapped to shardings (:func:`megatron_placement`); NCCL M2N
system configs and the published refit rows (:func:`published_configs`).
"""

from jreshard.models.deepseek import deepseek_v3 as deepseek_v3
from jreshard.models.deepseek import kimi_k2 as kimi_k2
from jreshard.models.hf import model_from_hf_config as model_from_hf_config
from jreshard.models.hf import read_hf_config as read_hf_config
from jreshard.models.llama3 import llama3_70b as llama3_70b
from jreshard.models.megatron import MegatronParallel as MegatronParallel
from jreshard.models.megatron import MegatronPlacement as MegatronPlacement
from jreshard.models.megatron import megatron_layouts as megatron_layouts
from jreshard.models.megatron import megatron_placement as megatron_placement
from jreshard.models.qwen3 import qwen3_235b as qwen3_235b
from jreshard.models.recipes import MODELS as MODELS
from jreshard.models.recipes import Recipe as Recipe
from jreshard.models.recipes import Refit as Refit
from jreshard.models.recipes import refit as refit
from jreshard.models.system import CLUSTERS as CLUSTERS
from jreshard.models.system import Cluster as Cluster
from jreshard.models.system import SystemConfig as SystemConfig
from jreshard.models.system import SystemRefit as SystemRefit
from jreshard.models.system import published_configs as published_configs
from jreshard.models.system import read_system_config as read_system_config
from jreshard.models.system import system_config_from_dict as system_config_from_dict
from jreshard.models.system import system_refit as system_refit
from jreshard.models.table import Model as Model
from jreshard.models.table import Parallelism as Parallelism
from jreshard.models.table import Param as Param
from jreshard.models.table import ParamRole as ParamRole
from jreshard.models.table import refit_topology as refit_topology

__all__ = [
    "CLUSTERS",
    "MODELS",
    "Cluster",
    "MegatronParallel",
    "MegatronPlacement",
    "SystemConfig",
    "SystemRefit",
    "megatron_layouts",
    "megatron_placement",
    "model_from_hf_config",
    "published_configs",
    "read_hf_config",
    "read_system_config",
    "system_config_from_dict",
    "system_refit",
    "Model",
    "Param",
    "Parallelism",
    "Recipe",
    "Refit",
    "ParamRole",
    "deepseek_v3",
    "kimi_k2",
    "llama3_70b",
    "qwen3_235b",
    "refit",
    "refit_topology",
]
