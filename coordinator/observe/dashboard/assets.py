"""The dashboard page's own files (HTML, its script and styles, uPlot), read once from the package.

Nothing else is ever served from disk, so no path from a request reaches the file system.
"""

from __future__ import annotations

from pathlib import Path

STATIC = Path(__file__).parent / "static"
CONTENT_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
                 ".css": "text/css; charset=utf-8"}


def static_files(root: Path = STATIC) -> dict[str, tuple[bytes, str]]:
    """URL path -> (bytes, content type) for every file the page may load; the page itself is
    ``/static/index.html`` (served at ``/`` too)."""
    files = {}
    for path in sorted(root.rglob("*")):
        ctype = CONTENT_TYPES.get(path.suffix)
        if path.is_file() and ctype:
            files["/static/" + path.relative_to(root).as_posix()] = (path.read_bytes(), ctype)
    return files
