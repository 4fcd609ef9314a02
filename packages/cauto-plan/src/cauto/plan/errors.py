"""Errors raised when a cauto document cannot be read, validated or matched."""

from __future__ import annotations


class DocumentError(ValueError):
    """A cauto document is malformed or does not fit its schema.

    ``path`` is the JSON path of the offending value ("$" for the document itself), ``expected``
    says what would have been valid there, and ``source`` names the file when there is one.
    """

    def __init__(self, message: str, *, path: str = "$", expected: str | None = None, source: str | None = None):
        self.path = path
        self.expected = expected
        self.source = source
        where = f"{source}: " if source else ""
        text = f"{where}at {path}: {message}"
        if expected:
            text += f" (expected {expected})"
        super().__init__(text)


class VersionError(DocumentError):
    """A document's schema major version is not one this cauto-plan can read."""


class MismatchError(ValueError):
    """A plan does not belong to the graph or model it is being used with."""


class OutputError(ValueError):
    """An output path cannot be written safely (not a regular file, a symbolic link, an unwritable folder);
    the message names the user's path and what to do."""
