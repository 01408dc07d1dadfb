"""What may leave the controller: host strings made safe for pages, plots and logs, and the leak check.

Everything a host sends (GPU names, versions, kernel and config names, error text) is untrusted.
`plain` turns such a value into one bounded line with addresses, logins and key paths redacted;
`md` also escapes it for markdown, so it cannot break a table, open a link, load a remote image or
inject HTML; `line` escapes it for rich instead, for a log record, a terminal or a Prefect artifact
cell (`prefect deployment run --watch` and kdbench's own CLI render rich markup: `[/x]` would stop
them, `[link=...]` make a link); `fenced` quotes verbatim output in a code block it cannot close. `leaks` is the last
check before a page or a commit leaves: it names what the text would reveal. Matching first normalises the text (NFKC, invisible characters dropped) and ignores
letter case, so an address cannot slip through as `10.0.0.1` split by a zero-width space, in
full-width digits, or as `GPU-BOX.lab` for `gpu-box.lab`.
"""

from __future__ import annotations

import ipaddress
import re
import unicodedata
from typing import TYPE_CHECKING, Any, Callable

from rich.markup import escape

if TYPE_CHECKING:
    from flows.inventory.hosts import Host, Inventory

CAP = 200               # characters kept of one host string
LINE_CAP = 2000         # of one host line in a log record: far below Prefect's 64 KiB per record
REDACTED = "[redacted]"

_OCTET = r"(?:25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)"
# Every pattern runs in linear time (fixed-width lookbehinds, possessive runs): a host may send megabytes.
# not part of a longer dotted number (1.2.3.4.5), but inside a name it counts (10.0.0.1.nip.io)
_IPV4 = re.compile(rf"(?<!\d)(?<!\d\.){_OCTET}(?:\.{_OCTET}){{3}}(?!\.?\d)")
# candidates only; ipaddress decides (a time such as 10:00:00 or C++'s std::vector is not one)
_IPV6 = re.compile(r"(?<![\w:.%])[0-9a-f:.]++(?:%[\w.-]++)?+(?![\w:.%])", re.IGNORECASE)
_TOKEN = re.compile(r"(?<!\S)\S++")
_KEYISH = re.compile(r"(?:~|/home|/root)/|\.ssh\b|\bid_(?:rsa|ed25519|ecdsa)", re.IGNORECASE)
_PRIVATE_KEY = re.compile(r"BEGIN [A-Z ]{0,40}PRIVATE KEY")
_LOGIN = re.compile(r"(?<![\w.-])[\w.-]++@(?=[\w\[])")
# markdown: what starts code, a link or image, HTML, a heading, a table cell, an entity or math (not
# emphasis: harmless, and `_` is common in kernel names)
_MD_SPECIAL = re.compile(r"([\\`\[\]<>|!#&$])")
# bare URLs that GitHub would turn into links: break `://` and `www.` with escapes
_AUTOLINK = re.compile(r"://|(?<![\w.])www\.", re.IGNORECASE)


def _is_ipv6(m: re.Match[str]) -> bool:
    text = m.group(0)
    if text.count(":") < 2 or not any(c in "0123456789abcdefABCDEF" for c in text):
        return False
    try:
        ipaddress.IPv6Address(text)
    except ValueError:
        return False
    return True


def _is_keyish(m: re.Match[str]) -> bool:
    return _KEYISH.search(m.group(0)) is not None


Pattern = tuple[str, re.Pattern[str], Callable[[re.Match[str]], bool] | None]


def normalise(text: str) -> str:
    """NFKC, with format characters (zero-width spaces and joiners, bidi controls, soft hyphens) dropped."""
    return "".join(c for c in unicodedata.normalize("NFKC", text) if unicodedata.category(c) != "Cf")


def _host_patterns(h: Host, names: set[str]) -> list[Pattern]:
    word = r"(?<![\w.-]){}(?![\w.-])"
    pats: list[Pattern] = []
    # an address that is a host's name (a DNS alias) reveals nothing the pages do not already say
    if h.address.lower() not in names:
        pats.append((f"the address of {h.name}", re.compile(word.format(re.escape(h.address)), re.IGNORECASE), None))
    pats.append((f"the key path of {h.name}", re.compile(word.format(re.escape(h.key_file)), re.IGNORECASE), None))
    # a user name is often a common word (root, kdbench): look for it where it names a login
    pats.append((f"the user of {h.name}",
                 re.compile(rf"(?<![\w.-]){re.escape(h.user)}@|/home/{re.escape(h.user)}\b", re.IGNORECASE), None))
    return pats


def patterns(inv: Inventory | None = None, generic: bool = True) -> list[Pattern]:
    """The inventory's addresses, key paths and logins, then (generic) anything shaped like one."""
    hosts = list(inv.hosts.values()) if inv else []
    names = {h.name.lower() for h in hosts}
    pats = [p for h in hosts for p in _host_patterns(h, names)]
    if generic:
        pats += [("an IPv4 address", _IPV4, None), ("an IPv6 address", _IPV6, _is_ipv6),
                 ("a home or key path", _TOKEN, _is_keyish),
                 ("a home or key path", _PRIVATE_KEY, None), ("a login (user@host)", _LOGIN, None)]
    return pats


def leaks(text: str, inv: Inventory | None = None, generic: bool = True) -> list[str]:
    """What `text` would reveal: inventory addresses, logins and key paths, or anything shaped like them.

    Returns labels, never the matched text, so the error that reports a leak does not repeat it.
    """
    text = normalise(text)
    return sorted({label for label, pat, ok in patterns(inv, generic)
                   if any(ok is None or ok(m) for m in pat.finditer(text))})


def redact(text: str, inv: Inventory | None = None) -> str:
    """`text` normalised, with everything `leaks` would name replaced by [redacted]."""
    text = normalise(text)
    for _, pat, ok in patterns(inv):
        text = pat.sub(lambda m: REDACTED if ok is None or ok(m) else m.group(0), text)
    return text


def plain(value: Any, inv: Inventory | None = None, cap: int = CAP) -> str:
    """A host string as one safe line of plain text: controls become spaces, leaks are redacted, capped."""
    text = "".join(" " if unicodedata.category(c) == "Cc" else c for c in normalise(str(value)))
    text = redact(" ".join(text.split()), inv)
    return text if len(text) <= cap else text[: cap - 1] + "…"


def line(value: Any, inv: Inventory | None = None, cap: int = LINE_CAP) -> str:
    """A host string for a log record, a terminal or an artifact cell: `plain`, then rich markup escaped."""
    return escape(plain(value, inv, cap))


def md(value: Any, inv: Inventory | None = None, cap: int = CAP) -> str:
    """A host string for a markdown page or table cell: `plain`, then every markdown-active character escaped."""
    text = _MD_SPECIAL.sub(r"\\\1", plain(value, inv, cap))
    return _AUTOLINK.sub(lambda m: "".join("\\" + c if c in ":/." else c for c in m.group(0)), text)


def fenced(text: str) -> str:
    """text as a markdown code block whose fence no line of it can close (host output, verbatim)."""
    text = "".join(c for c in text if c in "\n\t" or unicodedata.category(c) != "Cc")
    fence = "`" * max(3, 1 + max((len(r) for r in re.findall(r"`+", text)), default=0))
    return f"{fence}\n{text}\n{fence}"
