"""A stable identity for a root-cause line, so an unknown crash can be counted and tracked.

The same crash seen on another day, host, pid, GPU or package version must give the same
fingerprint, and two different crashes two different ones. So the variable parts of the line
(times, addresses, paths, versions, sizes, numbers, hosts, ids) are masked before hashing, and
what stays is the wording of the error, which is what tells crashes apart.
"""

from __future__ import annotations

import hashlib
import re

# Order matters: wide tokens (URLs, paths, timestamps, IPs) go before the numbers inside them.
_MASKS: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"\x1b?\[\d{1,3}(?:;\d{1,3})*m"), ""),
    # A scheme runs to the end of its [a-z0-9+.-] run: test that once per run (the lookahead), not
    # once per word start inside it, which made `A.A.A...` quadratic (2.8 s for 16k characters).
    (
        re.compile(
            r"(?<![a-z0-9+.-])(?=[a-z0-9+.-]*+://\S)(?P<pre>[a-z0-9+.-]*?)\b[a-z][a-z0-9+.-]*+://\S+",
            re.IGNORECASE,
        ),
        r"\g<pre><url>",
    ),
    (
        re.compile(
            r"\b\d{4}-\d\d-\d\d(?:[T ]\d\d:\d\d(?::\d\d)?(?:[.,]\d+)?(?:Z|[+-]\d\d:?\d\d)?)?"
            r"|\b\d\d:\d\d:\d\d(?:[.,]\d+)?"
        ),
        "<time>",
    ),
    (
        re.compile(r"\b[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}\b", re.I),
        "<uuid>",
    ),
    (re.compile(r"\b(?:\d{1,3}\.){3}\d{1,3}(?::\d+)?\b"), "<ip>"),
    (re.compile(r"\b(?:[0-9a-f]{1,4}:){3,7}[0-9a-f]{1,4}\b", re.I), "<ip>"),
    # PCI addresses (0000:b3:00.0) before paths and hex.
    (re.compile(r"\b[0-9a-f]{4,8}:[0-9a-f]{2}:[0-9a-f]{2}(?:\.[0-7])?\b", re.I), "<pci>"),
    (re.compile(r"(?:[A-Za-z]:)?(?:~|\.{1,2})?(?:/[\w.@+=,-]+)+/?"), "<path>"),
    (re.compile(r"\b0x[0-9a-f]+\b", re.I), "<hex>"),
    (re.compile(r"\b(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{8,}\b", re.I), "<hex>"),
    (
        re.compile(
            # Only from the first digit of a run: retrying inside it was quadratic (18 s).
            r"[-+]?(?<!\d)\d+(?:\.\d+)?\s?(?:[KMGTP]i?B|bytes|B)\b",
        ),
        "<size>",
    ),
    # Versions: 0.6.3, 12.4, 0.6.8.post1, 2.25.1+cu124, v1.4.0rc2.
    (
        re.compile(r"\bv?\d+(?:\.\d+)+(?:[.+-]?(?:post|dev|rc|a|b|cu|rocm|git)[\w.]*)*\b", re.I),
        "<ver>",
    ),
    # `\s*(?:[=:]\s*)?` is `\s*[=:]?\s*` without the quadratic split of a run of spaces.
    (re.compile(r"\b(?:pid|tid|rank|port|device|gpu|cuda|ip)\s*(?:[=:]\s*)?\d+\b", re.I), "<id>"),
    (re.compile(r"[-+]?\d+"), "<n>"),
    (re.compile(r"\s+"), " "),
)

# Module paths of exception classes change between releases (torch.cuda.OutOfMemoryError
# became torch.OutOfMemoryError); the class name is what identifies the crash.
_EXC_MODULE = re.compile(r"^(?:[A-Za-z_]\w*\.)+(?=[A-Z]\w*(?:Error|Exception)\b)")


def normalise(root_cause: str) -> str:
    """The root-cause line with its variable parts masked; what the fingerprint hashes."""
    text = _EXC_MODULE.sub("", root_cause.strip())
    for pattern, replacement in _MASKS:
        text = pattern.sub(replacement, text)
    return text.strip()


def fingerprint(root_cause: str) -> str:
    """16 hex characters of the SHA-256 of the normalised root-cause line."""
    digest = hashlib.sha256(normalise(root_cause).encode("utf-8", "replace")).hexdigest()
    return digest[:16]
