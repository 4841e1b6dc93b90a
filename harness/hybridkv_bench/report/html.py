"""A report's Markdown as one self-contained HTML file: the pictures inline (base64 data URIs), the style in the
page, nothing fetched from anywhere, so a team can attach it to a pull request as it is."""

from __future__ import annotations

import base64
import html
import re
from pathlib import Path

from markdown_it import MarkdownIt

STYLE = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 2em auto; max-width: 1400px; padding: 0 1em; color: #222; }
table { border-collapse: collapse; margin: 0.6em 0 1.2em; font-size: 12px; }
th, td { border: 1px solid #ccc; padding: 3px 7px; }
th { background: #f3f3f3; }
tr:nth-child(even) td { background: #fafafa; }
img { max-width: 100%; border: 1px solid #ddd; }
code { background: #f3f3f3; padding: 0 3px; }
blockquote { border-left: 4px solid #c33; margin: 1em 0; padding: 0.2em 1em; background: #fff4f4; }
"""
_IMG = re.compile(r'<img src="([^"]+)"')


def _inline(match: re.Match, folder: Path) -> str:
    """An <img> whose src is a file beside the report becomes a data URI of its bytes."""
    src = html.unescape(match.group(1))
    if src.startswith("data:") or "://" in src:
        raise ValueError(f"a self-contained report cannot point at {src!r}")
    path = folder / src
    mime = {".png": "image/png", ".svg": "image/svg+xml", ".jpg": "image/jpeg"}.get(path.suffix.lower())
    if mime is None:
        raise ValueError(f"picture {path} is not a PNG, SVG or JPEG")
    return f'<img src="data:{mime};base64,{base64.b64encode(path.read_bytes()).decode()}"'


def render_html(markdown: str, folder: Path, title: str) -> str:
    """The page for `markdown`, whose pictures are files in `folder`."""
    body = MarkdownIt("commonmark", {"html": False}).enable("table").render(markdown)
    body = _IMG.sub(lambda m: _inline(m, folder), body)
    return (f'<!doctype html>\n<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
            f"<style>{STYLE}</style></head>\n<body>\n{body}</body></html>\n")


def write_html(markdown_path: Path, out: Path, title: str) -> Path:
    """Write the HTML page of a Markdown report (its pictures beside it) to `out`."""
    out.write_text(render_html(markdown_path.read_text(), markdown_path.parent, title))
    return out
