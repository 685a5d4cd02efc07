"""HTML fragments of the report: every user-provided string goes through :func:`text`."""

from __future__ import annotations

import html
import math
import re

__all__ = ["PAGE", "number", "text", "token_span"]

# Bidi controls (Trojan-source reordering) and C0/C1 controls are shown, never obeyed; lone
# surrogates (e.g. from a bad decode) cannot be written as UTF-8 and are shown too.
_CONTROLS = re.compile("[\u202a-\u202e\u2066-\u2069\u200e\u200f\u061c\x00-\x08\x0b\x0c"
                       "\x0e-\x1f\x7f-\x9f\ud800-\udfff]")


def text(value: object, *, limit: int = 400) -> str:
    """``value`` as escaped HTML text (quotes too), controls made visible, cut to ``limit``."""
    raw = str(value)
    if len(raw) > limit:
        raw = raw[:limit] + "\u2026"
    shown = _CONTROLS.sub(lambda m: f"\u27e8U+{ord(m.group()):04X}\u27e9", raw)
    return "<bdi>" + html.escape(shown, quote=True) + "</bdi>"


def number(value: float) -> str:
    """A score for display: ``+1.234e-02``, or ``nan`` / ``+inf`` / ``-inf``."""
    if math.isnan(value):
        return "nan"
    if math.isinf(value):
        return "+inf" if value > 0 else "-inf"
    return f"{value:+.4g}"


def token_span(token: str, value: float, scale: float) -> str:
    """One token, its background green (positive) or red (negative) by ``|value| / scale``."""
    if not math.isfinite(value):
        colour = "rgba(128,128,128,0.5)"
    else:
        alpha = min(abs(value) / scale, 1.0) if scale > 0 else 0.0
        colour = (f"rgba(0,160,0,{alpha:.2f})" if value >= 0 else f"rgba(220,0,0,{alpha:.2f})")
    label = html.escape(number(value), quote=True)
    return f'<span class="tok" style="background:{colour}" title="{label}">{text(token)}</span>'


PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="default-src 'none'; img-src data:; \
style-src 'unsafe-inline'">
<title>{title}</title>
<style>
body{{font:14px system-ui,sans-serif;margin:1.5em;color:#222}}
h1{{font-size:1.4em}} h2{{font-size:1.1em;margin-top:1.6em;border-top:1px solid #ccc;\
padding-top:.6em}}
table{{border-collapse:collapse;margin:.3em 0}} td,th{{padding:2px 8px;text-align:left;\
vertical-align:top}}
tr.pro td.score{{color:#070}} tr.opp td.score{{color:#a00}} td.score{{font-family:monospace}}
.thumb{{display:inline-block;width:32px;height:32px;image-rendering:pixelated;\
border:1px solid #aaa}}
.doc{{font-family:monospace;white-space:pre-wrap;max-width:60em}} .tok{{border-radius:2px}}
.note{{color:#666}} .cols{{display:flex;gap:2em;flex-wrap:wrap}}
</style></head><body>
<h1>{title}</h1>
<p class="note">{summary}</p>
{body}
</body></html>
"""
