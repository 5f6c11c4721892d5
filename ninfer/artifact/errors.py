"""The one exception every artifact problem raises, so callers catch a single type."""

from __future__ import annotations


class ArtifactError(Exception):
    """A `.ninfer` file (or what a writer was asked to put in one) is not valid.

    The message names the file and the one problem found, e.g. ``model.ninfer: truncated: ...``.
    """
