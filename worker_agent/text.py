"""Trainer output as text: terminal escape sequences and control characters removed, and which line says something."""

import re

# ECMA-48 escape sequences, as terminals and colour libraries write them: OSC (window titles, links) and
# the other string sequences up to their terminator (BEL or ST; unterminated: to the end of the line), CSI
# (colours, cursor moves: ``\x1b[0m``, ``\x1b[A``), and the two- and three-byte escapes (``\x1b(B``, ``\x1b7``).
_ESCAPES = re.compile(
    r"""
      \x1b\][^\x07\x1b]*(?:\x07|\x1b\\)?           # OSC ... BEL | ST
    | \x1b[P^_X][^\x1b]*(?:\x1b\\)?                # DCS, PM, APC, SOS ... ST
    | (?:\x1b\[|\x9b)[\x30-\x3f]*[\x20-\x2f]*[\x40-\x7e]   # CSI parameters, intermediates, final byte
    | \x1b[\x20-\x2f]*[\x30-\x7e]                  # nF, Fp, Fe and Fs escapes
    """,
    re.VERBOSE,
)
# What is left that a terminal would not show as text: C0 controls but tab, DEL, C1 controls.
_CONTROLS = re.compile(r"[\x00-\x08\x0a-\x1f\x7f-\x9f]")
_WORD = re.compile(r"\w")


def plain(text):
    """Return ``text`` without terminal escape sequences (CSI and OSC included) and control characters; a tab stays."""
    return _CONTROLS.sub("", _ESCAPES.sub("", text))


def says_something(line):
    """Return whether ``line`` (already ``plain``) holds a letter or a digit: not blank, not only punctuation."""
    return bool(_WORD.search(line))


def first_line(text, max_chars):
    """Return the first line of ``text`` that says something, ``plain`` and stripped, cut to ``max_chars``; or ""."""
    for line in str(text).splitlines():
        line = plain(line).strip()
        if says_something(line):
            return line[:max_chars]
    return ""
