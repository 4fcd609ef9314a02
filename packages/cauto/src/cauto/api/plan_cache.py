"""Plans cached on disk, keyed by graph fingerprint + cluster + budget + solver options.

A cached plan is plain JSON validated on read (cauto.plan.load), so a stale or tampered file is
rejected with a clear error and re-solved, never executed.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from cauto.plan import DocumentError, dump, load


def default_cache_dir() -> Path:
    """$CAUTO_CACHE_DIR, else $XDG_CACHE_HOME/cauto/plans, else ~/.cache/cauto/plans."""
    if os.environ.get("CAUTO_CACHE_DIR"):
        return Path(os.environ["CAUTO_CACHE_DIR"])
    base = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return base / "cauto" / "plans"


class PlanCache:
    """Directory of plan documents named by a hash of everything that determines the plan."""

    def __init__(self, directory: str | os.PathLike | None = None):
        self.directory = Path(directory) if directory is not None else default_cache_dir()

    @staticmethod
    def key(fingerprint: str, cluster: dict, options: dict) -> str:
        """Hex digest of the graph fingerprint, the cluster spec and the solver options."""
        blob = json.dumps([fingerprint, cluster, options], sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()[:32]

    def path(self, key: str) -> Path:
        return self.directory / f"plan-{key}.json"

    def get(self, key: str) -> dict | None:
        """The cached plan for ``key``, or None when absent or unreadable (then it is re-solved)."""
        path = self.path(key)
        if not path.is_file():
            return None
        try:
            return load(path, "plan")
        except DocumentError:
            return None

    def put(self, key: str, plan: dict) -> Path:
        """Store ``plan`` atomically; return its path."""
        return dump(plan, self.path(key))
