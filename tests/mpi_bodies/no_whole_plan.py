"""Make every function that plans the whole cluster raise, and record which ranks get a rank plan.

Used by the per-process tests: on the front door's multi-process path a process plans and
schedules only the ranks it drives. Guarded: the whole plan (``plan_layouts``' cached planner and
``plan_tensor``, which plans every unit of a tensor), slicing a plan into rank plans
(``Plan.rank_plan``/``Plan.rank_plans``) and the global schedule (``build_schedule``'s builder).
"""

from __future__ import annotations

from typing import Any


class WholePlanCalled(AssertionError):
    pass


def guard(patch: Any) -> list[int]:
    """Patch with ``patch(obj, name, value)`` (pytest's ``monkeypatch.setattr`` or :func:`setattr`);
    return the list the ranks given a rank plan are appended to."""
    from jreshard.sharding import plan, planner

    def refuse(what: str):
        def call(*args: Any, **kwargs: Any) -> Any:
            raise WholePlanCalled(f"{what} was called on the per-process path")

        return call

    patch(planner, "_plan_cached", refuse("the whole plan (plan_layouts)"))
    patch(planner, "plan_tensor", refuse("plan_tensor (every unit of a tensor)"))
    patch(plan.Plan, "rank_plan", refuse("Plan.rank_plan"))
    patch(plan.Plan, "rank_plans", refuse("Plan.rank_plans"))
    planned_ranks: list[int] = []
    inner = planner._rank_plan_cached

    def record(pairs: Any, rank: int, topology: Any, options: Any) -> Any:
        planned_ranks.append(rank)
        return inner(pairs, rank, topology, options)

    patch(planner, "_rank_plan_cached", record)
    return planned_ranks
