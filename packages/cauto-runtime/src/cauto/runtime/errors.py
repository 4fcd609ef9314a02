"""Errors of the runtime that name what to change."""

from cauto.plan import MismatchError


class PlanMismatchError(MismatchError):
    """The plan, the model or the mesh do not belong together; the message says which and what to do."""


__all__ = ["PlanMismatchError"]
