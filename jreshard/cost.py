"""The cost model: ``predict(plan, topology) -> Prediction`` (re-exports only).

Every number it gives is a prediction of a documented model (see
``jreshard.sharding.cost`` and ``docs/cost_model.md``), never a measurement.
"""

from jreshard.sharding.cost import Port as Port
from jreshard.sharding.cost import Prediction as Prediction
from jreshard.sharding.cost import predict as predict

__all__ = ["Port", "Prediction", "predict"]
