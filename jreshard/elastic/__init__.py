"""Elastic refit: inference replicas join, leave and fail while the trainer keeps pushing versions.

One :class:`ElasticTrainer` (one process, or one in each process of the trainer's jax cluster)
serves any number of :class:`ElasticReplica` processes on any hosts, each over its own
authenticated connection, the weights over NIXL; see ``docs/elastic.md``.
"""

from jreshard.elastic.replica import ElasticReplica as ElasticReplica
from jreshard.elastic.trainer import ElasticTrainer as ElasticTrainer
from jreshard.elastic.types import Arrival as Arrival
from jreshard.elastic.types import CatchUp as CatchUp
from jreshard.elastic.types import Publication as Publication
from jreshard.elastic.types import PushReport as PushReport
from jreshard.elastic.types import ReplicaInfo as ReplicaInfo
from jreshard.elastic.types import ReplicaState as ReplicaState

__all__ = [
    "Arrival",
    "CatchUp",
    "ElasticReplica",
    "Publication",
    "ElasticTrainer",
    "PushReport",
    "ReplicaInfo",
    "ReplicaState",
]
