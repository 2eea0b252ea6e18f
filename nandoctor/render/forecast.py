"""The forecast in words: the warning line `watch`, `Guard` and the callbacks print the
moment one fires, and its Markdown section. A forecast is a cause seen before its
failure, so its fix is the cause's own, from the catalog::

    nandoctor: forecast at step 13: log-of-softmax in about 5 steps (step 18), outside the
    model (the loss) (aten._softmax.default): softmax_spread 6.66 of 17.3; the widest
    spread ... grew 1.3x a step over the last 13 steps ...; fix: Use `F.cross_entropy(...)`

Reads the report's forecasts and the catalog's text; computes nothing. No rich here.
"""

from __future__ import annotations

from nandoctor.causes import catalog
from nandoctor.report.forecast import Forecast, forecast_text


def fix_of(kind: str) -> str:
    """The catalog's fix of the cause a forecast names."""
    try:
        return catalog.get(kind).fix
    except KeyError:
        return ""


def warning_line(forecast: Forecast, who: str = "nandoctor") -> str:
    """One line, said once, when the forecast first fires."""
    fix = fix_of(forecast.kind)
    return f"{who}: forecast at {forecast_text(forecast)}" + (f"; fix: {fix}" if fix else "")


def forecast_markdown(forecasts: list[Forecast], failed_at: int | None) -> list[str]:
    """The Markdown section: each forecast, how long before the failure it came (when the
    run failed), and its fix."""
    if not forecasts:
        return []
    out = ["### Forecast", ""]
    for f in forecasts:
        lead = f" ({failed_at - f.step} steps before the failure)" if failed_at is not None else ""
        out.append(f"- **{f.kind}** ({f.confidence:.0%}){lead}: {forecast_text(f)}")
        fix = fix_of(f.kind)
        if fix:
            out.append(f"  - **fix:** {fix}")
    return [*out, ""]


__all__ = ["fix_of", "forecast_markdown", "warning_line"]
