"""Model factories named on command lines: TARGET is 'path/to/file.py:fn' or 'package.module:fn'.

Shared by cauto-profile, cauto-codegen, the runtime launcher and `cauto run`, so one TARGET with
the same --batch/--seq means the same model (and the same graph fingerprint) everywhere.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
from pathlib import Path


class UsageError(Exception):
    """Bad input the user can fix; printed without a traceback."""


def load_target(target: str):
    """The factory named by TARGET ('file.py:fn' or 'pkg.module:fn')."""
    module_part, sep, attr = target.rpartition(":")
    if not sep or not module_part or not attr:
        raise UsageError(f"target {target!r} must look like path/to/file.py:function or package.module:function")
    if module_part.endswith(".py") or "/" in module_part or Path(module_part).suffix == ".py":
        path = Path(module_part)
        if not path.is_file():
            raise UsageError(f"file not found: {path}")
        spec = importlib.util.spec_from_file_location(f"_cauto_target_{path.stem}", path)
        module = importlib.util.module_from_spec(spec)
        sys.path.insert(0, str(path.resolve().parent))
        try:
            spec.loader.exec_module(module)
        except Exception as exc:
            raise UsageError(f"importing {path} failed: {type(exc).__name__}: {exc}") from exc
        finally:
            sys.path.pop(0)
    else:
        try:
            module = importlib.import_module(module_part)
        except ModuleNotFoundError as exc:
            raise UsageError(f"module not found: {module_part} ({exc})") from exc
        except Exception as exc:
            raise UsageError(f"importing {module_part} failed: {type(exc).__name__}: {exc}") from exc
    fn = getattr(module, attr, None)
    if fn is None:
        raise UsageError(f"{module_part} has no attribute {attr!r}")
    if not callable(fn):
        raise UsageError(f"{target} is not callable")
    return fn


def bind_sizes(fn, sizes: dict):
    """Pass --batch/--seq to fn when it accepts them (or **kwargs); error when it does not."""
    sizes = {k: v for k, v in sizes.items() if v is not None}
    if not sizes:
        return fn
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        params = {}
    accepts_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    unknown = [k for k in sizes if k not in params and not accepts_any]
    if unknown:
        raise UsageError(f"{getattr(fn, '__name__', fn)} takes no argument {unknown[0]!r} "
                         f"(it accepts: {', '.join(params) or 'nothing'})")

    def bound():
        return fn(**sizes)

    bound.__name__ = getattr(fn, "__name__", "model")
    return bound
