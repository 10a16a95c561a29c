"""The key report as one static HTML page, for a ticket or an email (``durable keys --html``)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from datetime import datetime
from html import escape
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..observe.activity import KeyEntry

_STYLE = """
body { font: 14px/1.4 system-ui, -apple-system, "Segoe UI", sans-serif; color: #1f2328; margin: 2em; }
h1 { font-size: 1.4em; margin: 0 0 .2em; }
h2 { font-size: 1.1em; margin: 1.6em 0 .5em; }
p.meta { color: #59636e; margin: 0 0 1em; }
p.summary { font-size: 1.1em; }
table { border-collapse: collapse; }
th, td { border: 1px solid #d1d9e0; padding: .3em .6em; text-align: left; vertical-align: top; }
th { background: #f6f8fa; }
td.num { text-align: right; }
td.id, td.key { font-family: ui-monospace, Menlo, Consolas, monospace; word-break: break-all; }
.blocks { color: #9a6700; font-weight: 600; }
.free { color: #1a7f37; }
p.legend { color: #59636e; max-width: 60em; }
"""

_COLUMNS = ("workflow", "key", "holder", "holder status", "blocks", "waiting run", "runs", "re-adds (24 h)")


def render_key_report(
    entries: Sequence[KeyEntry], *, generated_at: datetime, scope: str = "all keys", top: int = 10
) -> str:
    """One self-contained HTML page: a summary, the keys re-added most in the last day, and
    one row per key with its holder and whether it blocks a new start."""
    blocking = sum(1 for e in entries if e.blocks)
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>durable keys: {_text(scope)}</title>",
        f"<style>{_STYLE}</style></head><body>",
        "<h1>Key report</h1>",
        f'<p class="meta">{_text(scope)} &middot; generated at {_text(_when(generated_at))}</p>',
        f'<p class="summary">{len(entries)} key{"" if len(entries) == 1 else "s"}: '
        f'<span class="blocks">{blocks_new_starts(blocking)}</span>, '
        f'<span class="free">{len(entries) - blocking} free to take</span></p>',
        *_top_keys(entries, top),
        "<h2>Keys</h2>",
        *_key_table(entries),
        '<p class="legend"><b>blocks</b>: a new start with the key gets the holder (by the '
        "workflow's <code>on_duplicate</code>): the holder is still going, or it finished and the "
        "workflow's <code>reuse</code> keeps the key. <b>free to take</b>: the holder finished and "
        "the next start takes the key.</p>",
        "</body></html>",
    ]
    return "\n".join(parts) + "\n"


def blocks_new_starts(n: int) -> str:
    """ "1 blocks new starts", "2 block new starts"."""
    return f"{n} {'blocks' if n == 1 else 'block'} new starts"


def _top_keys(entries: Iterable[KeyEntry], top: int) -> list[str]:
    ranked = sorted((e for e in entries if e.readds_last_day), key=lambda e: -e.readds_last_day)[:top]
    lines = ["<h2>Re-added most in the last 24 hours</h2>"]
    if not ranked:
        return [*lines, "<p>No key was re-added in the last 24 hours.</p>"]
    lines.append("<table><tr><th>workflow</th><th>key</th><th>re-adds</th></tr>")
    lines += [
        f'<tr><td>{_text(e.workflow)}</td><td class="key">{_text(e.key)}</td>'
        f'<td class="num">{e.readds_last_day}</td></tr>'
        for e in ranked
    ]
    return [*lines, "</table>"]


def _key_table(entries: Iterable[KeyEntry]) -> list[str]:
    head = "".join(f"<th>{_text(c)}</th>" for c in _COLUMNS)
    rows = [
        "<tr>"
        f"<td>{_text(e.workflow)}</td>"
        f'<td class="key">{_text(e.key)}</td>'
        f'<td class="id">{_text(e.holder_id)}</td>'
        f"<td>{_text(e.holder_status)}</td>"
        + ('<td class="blocks">blocks</td>' if e.blocks else '<td class="free">free to take</td>')
        + f'<td class="id">{_text(e.waiting_id or "-")}</td>'
        f'<td class="num">{e.runs}</td>'
        f'<td class="num">{e.readds_last_day}</td>'
        "</tr>"
        for e in entries
    ]
    if not rows:
        return ["<p>No keys.</p>"]
    return [f"<table><tr>{head}</tr>", *rows, "</table>"]


def _text(value: object) -> str:
    return escape(str(value), quote=True)


def _when(at: datetime) -> str:
    return at.strftime("%Y-%m-%d %H:%M:%S %Z").strip()
