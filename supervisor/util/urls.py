"""Sink URLs: whether one can be sent to at all, and taking its secret out of any text.

Pure and dependency-free (config imports it). `url_problem` answers in words that never quote
the URL. `redact` removes the URL, its path and query, the user info and every token-looking
path segment, plain, percent-encoded or in another case, and then any 8-character piece of
the secret that is left (a body that quotes only part of the path, or cut inside it).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from urllib.parse import quote, unquote, urlsplit

REDACTED = "<redacted>"
MIN_SECRET_SEGMENT = 8  # path segments this long are redacted on their own ("services" too)
SHINGLE = 8  # no piece of the secret path this long survives redaction
_MAX_PASSES = 4  # a secret that overlaps the marker itself: give up and withhold the text
_WITHHELD = "***"  # shorter than any shingle: cannot hold a piece of the secret
_SCHEMES = ("http", "https")


def url_problem(url: str) -> str | None:
    """Why `url` cannot be posted to (never quoting it), or None when it can."""
    if not url:
        return "empty"
    if any(c.isspace() or not c.isprintable() for c in url):
        return "contains whitespace or a control character"
    if not url.isascii():
        return "contains non-ASCII characters (percent-encode them)"
    try:
        parts = urlsplit(url)
        port = parts.port  # ValueError when not a number or out of range
    except ValueError:
        return "cannot be parsed (host or port malformed)"
    if parts.scheme.lower() not in _SCHEMES:
        return "scheme must be https or http"
    if not parts.hostname:
        return "has no host"
    if port == 0:
        return "port must be 1..65535"
    return None


def redact_all(text: str, urls: Iterable[str]) -> str:
    """`redact` for each of several URLs (an Alertmanager and its peers)."""
    for url in urls:
        text = redact(text, url)
    return text


def redact(text: str, url: str) -> str:
    """`text` without the URL's secret parts; a pure function that never raises."""
    secrets = secret_parts(url)
    if not secrets or not text:
        return text
    exact = re.compile("|".join(re.escape(s) for s in secrets), re.IGNORECASE)
    shingles = _shingles(url)
    for _ in range(_MAX_PASSES):
        text = _cover(exact.sub(REDACTED, text), shingles)
        if not any(s.lower() in text.lower() for s in secrets) and not _covered(text, shingles):
            return text
    return _WITHHELD


def secret_parts(url: str) -> list[str]:
    """The URL and its secret pieces (see `_secret_pieces`), each also percent-encoded and
    decoded; longest first. Never raises."""
    pieces = [url, *_secret_pieces(url)]
    forms = {f for p in pieces for f in (p, quote(p, safe=""), quote(p), unquote(p))}
    # A bare "/" or one character would redact half of any text.
    return sorted((f for f in forms if len(f) > 1), key=len, reverse=True)


def _secret_pieces(url: str) -> list[str]:
    """Path, query, user info, password and long path segments: what a token hides in."""
    try:
        parts = urlsplit(url)
        password = parts.password or ""
    except ValueError:
        return [url]
    userinfo = parts.netloc.rpartition("@")[0]
    pieces = [parts.path, parts.query, userinfo, password]
    return pieces + [seg for seg in parts.path.split("/") if len(seg) >= MIN_SECRET_SEGMENT]


def _shingles(url: str) -> set[str]:
    """Every SHINGLE-character piece of the secret pieces, in each form (not of the whole
    URL: its scheme and host are not secret, and would redact every "https://" of a text)."""
    out: set[str] = set()
    for piece in _secret_pieces(url):
        for form in (piece, quote(piece, safe=""), unquote(piece)):
            low = form.lower()
            out.update(low[i : i + SHINGLE] for i in range(len(low) - SHINGLE + 1))
    return out


def _covered(text: str, shingles: set[str]) -> bool:
    low = text.lower()
    return any(low[i : i + SHINGLE] in shingles for i in range(len(low) - SHINGLE + 1))


def _cover(text: str, shingles: set[str]) -> str:
    """Replace each run of characters inside a secret shingle by one marker."""
    if not shingles:
        return text
    low = text.lower()
    hit = [False] * len(text)
    for i in range(len(low) - SHINGLE + 1):
        if low[i : i + SHINGLE] in shingles:
            hit[i : i + SHINGLE] = [True] * SHINGLE
    out: list[str] = []
    for i, ch in enumerate(text):
        if not hit[i]:
            out.append(ch)
        elif i == 0 or not hit[i - 1]:
            out.append(REDACTED)
    return "".join(out)
