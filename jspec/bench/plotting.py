"""matplotlib for the benchmark scripts' plots: an optional extra (`jspec[plot]`).

`pyplot()` returns `matplotlib.pyplot` on the non-interactive Agg backend, or raises an
ImportError naming the extra to install. The scripts call it before any measuring, so a
missing extra ends the run at once instead of after the benchmark.
"""

from __future__ import annotations

PLOT_EXTRA = "jspec[plot]"


def pyplot():
    """matplotlib.pyplot (Agg), or ImportError naming `pip install 'jspec[plot]'`."""
    try:
        import matplotlib
    except ImportError as e:
        raise ImportError(f"plotting needs matplotlib, an optional extra: pip install "
                          f"'{PLOT_EXTRA}' (or pip install matplotlib)") from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def require_pyplot() -> None:
    """For a script's start: SystemExit with one line `error: ...` without matplotlib."""
    try:
        pyplot()
    except ImportError as e:
        raise SystemExit(f"error: {e}") from None
