"""transformers, imported without its "PyTorch was not found" advisory (jspec reads
checkpoints, configs and tokenizers without torch, so the notice reads like a broken
install). The advisory is printed once, at transformers' first import; other warnings are
untouched."""

from __future__ import annotations

import os
import sys

_QUIET = "TRANSFORMERS_NO_ADVISORY_WARNINGS"


def quiet_import() -> None:
    """Imports transformers with its advisories off for that import only (the caller's
    environment is restored); a no-op once it is imported."""
    if "transformers" in sys.modules:
        return
    before = os.environ.get(_QUIET)
    os.environ[_QUIET] = "1"
    try:
        import transformers  # noqa: F401
    finally:
        if before is None:
            os.environ.pop(_QUIET, None)
        else:
            os.environ[_QUIET] = before
