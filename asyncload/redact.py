"""What the loader writes about the user's values: bounded, and without their secrets.

Messages, ``loader.stats.failures``, the trace and the doctor show items, URLs, options and the
storage client's own error text; any of them may carry a credential (a presigned URL's
signature, ``https://user:pass@host``, a token echoed by a client, ``storage_options``'
``secret``). Every text they show goes through ``redact`` (one place, so one rule), and every
value through ``shown`` (a repr that a 1 MB key cannot make 1 MB long). The values themselves
(``SampleError.item``, ``Failure.item``) stay as the user gave them, to retry with.
"""

from __future__ import annotations

import pickle
import re
from typing import Any

HIDDEN = "***"
SHOWN_CHARS = 200  # the longest repr of an item a message shows
REDACTED_CHARS = 20_000  # text beyond this is cut before redacting: no regex runs over megabytes

# Names whose values are secrets: query parameters, options, ``name=value`` in a client's text.
# Every repetition before the secret's name is bounded: a 20,000-character key costs linear time.
# Matched inside a longer name too (X-Amz-Credential, sas_token, aws_secret_access_key); the short
# words that are also parts of other words only between '_', '-' or the name's ends (nasa_sas, not
# Kansas), and "private" only as a private key's (a ``private: true`` setting is no secret).
_SECRET_WORDS = (r"credential|token|secret|passw|pwd|authorization|(?<![a-z0-9])(?:session|sas)(?![a-z0-9])"
                 r"|private[_\-]?key|api[_\-]?key|access[_\-]?key|account[_\-]?key")
# An option's name (not skip_signature): those words, and names that hold a credential without
# one of them: requests' and webdav4's ``auth=(user, password)`` (``basic_auth``, ``proxy_auth``),
# paramiko's (sftp) ``pkey`` and ``passphrase``, a ``Cookie`` header or aiohttp's ``cookies``.
_SECRET_NAME = re.compile(rf"(?i)(?:{_SECRET_WORDS})|^(?:key|username|pass)$"
                          r"|(?<![a-z0-9])(?:auth|creds?|cookies?|pkey|passphrase)(?![a-z0-9])")

# A query parameter, plain or percent-encoded (a client's text may quote the URL it built: %3F, %26, %3D).
_QUERY = re.compile(rf"""(?i)((?:[?&;]|%3F|%26)[\w.\-]{{0,64}}?(?:{_SECRET_WORDS}|sig|key)[\w.\-]{{0,64}}?(?:=|%3D))
                         (?:[^&#;\s'"<>%]|%(?!26)[0-9a-f]{{2}})+""", re.X)
_USERINFO = re.compile(r"(?i)\b([a-z][a-z0-9+.\-]{0,30}://)[^/@\s'\"<>]{1,256}@")
_BEARER = re.compile(r"(?i)\b(bearer|basic)\s+[\w.~+/\-]+=*")
# 'name': 'value', "name": "value", name='value', name=value: a dict's repr, a client's config dump.
_NAMED = re.compile(rf"""(?ix)
    (['"]?)\b([\w\-]{{0,40}}?(?:{_SECRET_WORDS}|signature)[\w\-]{{0,40}}|key)\1   # a secret's name
    (\s*[:=]\s*)                                                         # : or =
    (?!(?:bearer|basic)\s|\*\*\*)(Some\()?('[^']*'|"[^"]*"|[^\s,;&#)}}\]'"]+)   # its value (a Bearer's is hidden)
""")
# Google OAuth, AWS access key ids, JWTs, GitHub's tokens.
_TOKENS = re.compile(r"\b(?:ya29\.[\w\-]+|(?:AKIA|ASIA)[0-9A-Z]{16}|eyJ[\w\-]+\.[\w\-]+\.[\w\-]+"
                     r"|gh[pousr]_[A-Za-z0-9]{30,}|github_pat_\w{30,})")
# What any of them needs, lower case: most texts (a plain URL, a number) hold none, and a plain
# substring test is cheap (0.6 us for a URL, where one case-blind regex costs 6 us and the five
# above 14 us), so a trace of 100,000 keys writes about as fast as unredacted.
_CLUES = ("?", "&", ";", "@", "%3f", "%26", "bearer", "basic", "ya29", "akia", "asia", "eyj", "credential", "token",
          "secret", "passw", "pwd", "authorization", "session", "sas", "key", "sig", "ghp_", "gho_", "ghu_", "ghs_",
          "ghr_", "github_pat_")


def redact(text: str) -> str:
    """``text`` with what looks like a secret replaced by ``***``: the values of secret-like
    query parameters (signatures, credentials, tokens; the path and the other parameters stay),
    a URL's userinfo, ``Bearer``/``Basic`` credentials, the values of secret-like names in
    ``name=value`` / ``'name': 'value'`` text, and tokens recognisable alone (Google OAuth
    ``ya29.``, AWS access key ids, JWTs)."""
    if len(text) > REDACTED_CHARS:
        text = text[:REDACTED_CHARS] + "..."
    if not _has_clue(text.lower()):
        return text
    text = _QUERY.sub(rf"\1{HIDDEN}", text)
    text = _USERINFO.sub(rf"\1{HIDDEN}@", text)
    text = _BEARER.sub(rf"\1 {HIDDEN}", text)
    text = _NAMED.sub(_hide_named, text)
    return _TOKENS.sub(HIDDEN, text)


def _has_clue(lower: str) -> bool:
    for clue in _CLUES:  # a loop, not any(): this is the cost of every clean text
        if clue in lower:
            return True
    return False


def _hide_named(match: re.Match) -> str:
    quote, name, separator, some, value = match.groups()
    before = match.string[match.start(2) - 1 : match.start(2)]
    # A bare ``key:`` is prose ("Configuration key: 'x'"); quoted, ``key=``, or the end of a longer
    # name (``X-Api-Key:``), it is an option.
    if name.lower() == "key" and not quote and "=" not in separator and before != "-":
        return match.group(0)
    rest = ""
    if before == "/" and not quote:  # a path's segment (data/tokenizer=bpe/x.jpg): the path goes on
        value, slash, rest = value.partition("/")
        rest = slash + rest
    hidden = repr(HIDDEN) if value[0] in "'\"" else HIDDEN
    return f"{quote}{name}{quote}{separator}{some or ''}{hidden}{rest}"


def shown(value: Any, limit: int = SHOWN_CHARS) -> str:
    """``repr(value)`` for a message: redacted, and at most about ``limit`` characters."""
    return bounded(repr(value), limit)


def bounded(text: str, limit: int = SHOWN_CHARS) -> str:
    """``text`` redacted and cut to about ``limit`` characters (a URL in the trace, a cause)."""
    text = redact(text)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def is_secret_name(name: Any) -> bool:
    """Whether an option named ``name`` holds a secret (key, secret, token, password, sas, ...)."""
    return isinstance(name, str) and bool(_SECRET_NAME.search(name))


def redact_options(options: Any) -> Any:
    """``storage_options`` to show: the keys all there, secret-like ones' values ``***``, nested
    dicts alike (``client_kwargs``, a service account dict), other text redacted (an endpoint's
    ``user:pass@``)."""
    if isinstance(options, str):
        return redact(options)
    if not isinstance(options, dict):
        return options
    return {key: HIDDEN if is_secret_name(key) else redact_options(value) for key, value in options.items()}


def unpicklable(value: Any) -> str:
    """What of ``value`` does not pickle, for a message that must not print it: in a dict (such as
    ``storage_options``) the first key whose value does not, with that value's type only;
    otherwise ``value``'s bounded, redacted repr."""
    if isinstance(value, dict):
        for key, item in value.items():
            try:
                pickle.dumps(item)
            except Exception:
                return f"its key {key!r} (a {type(item).__name__})"
        return f"a dict with keys {sorted(map(str, value))}"
    return shown(value, 80)
