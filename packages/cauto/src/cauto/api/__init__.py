"""cauto.api: profile, plan and apply in one call.

    from cauto.api import autoparallelize
    model = autoparallelize(model_fn, example_inputs, mesh, memory_budget="70GiB")
"""

from cauto.api.autoparallel import autoparallelize, plan_for
from cauto.api.plan_cache import PlanCache

__all__ = ["PlanCache", "autoparallelize", "plan_for"]
