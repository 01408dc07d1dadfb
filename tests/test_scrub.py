"""The leak check and the host-string helpers: what they catch, what they leave alone, what they escape."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from flows.inventory.hosts import Host, Inventory
from flows.inventory.scrub import fenced, leaks, md, plain, redact


def _inv(**hosts: dict) -> Inventory:
    base = dict(port=22, user="alice", key_file="/home/alice/.ssh/id_ed25519", spec="h200-sxm", gpus=1,
                arch="sm_90", interconnect="none", python="python3", work_dir="kdbench")
    return Inventory(dir=Path("."), hosts={n: Host(name=n, **{**base, **h}) for n, h in hosts.items()})


INV = _inv(gpubox={"address": "gpu-box.lab.internal"}, v6={"address": "2001:db8::7"})


@pytest.mark.parametrize("text, label", [
    ("on GPU-BOX.Lab.Internal today", "the address of gpubox"),              # another letter case
    ("reached 2001:DB8::7 first", "the address of v6"),                     # inventory IPv6, other case
    ("peer fe80::1ff:fe23:4567:890a%eth0 said no", "an IPv6 address"),      # any IPv6
    ("from [2001:db8:0:0:1::1]:22", "an IPv6 address"),
    ("10\u200b.20.30\u200d.40", "an IPv4 address"),                         # split by zero-width characters
    ("\uff11\uff10.20.30.40", "an IPv4 address"),                           # full-width digits
    ("gpu-box\u200b.lab.internal", "the address of gpubox"),
    ("key ~/.SSH/ID_ED25519 refused", "a home or key path"),
    ("ALICE@somewhere", "the user of gpubox"),
])
def test_leaks_normalise_before_matching(text: str, label: str) -> None:
    assert label in leaks(text, INV)
    assert label not in leaks(redact(text, INV), INV)


@pytest.mark.parametrize("text", ["at 10:00:00 UTC", "std::vector<int>", "ratio 1:2:3", "a :: b",
                                  "run 20261130T080310Z-h200ref", "H200 141 GB, driver 570.86.15"])
def test_leaks_leave_ordinary_text_alone(text: str) -> None:
    assert leaks(text) == [] and redact(text) == text


def test_a_host_named_like_its_address_is_not_a_leak() -> None:
    inv = _inv(b300={"address": "b300"}, gpubox={"address": "gpu-box.lab.internal"})
    assert leaks("# b300 (B300 SXM): projected", inv) == []
    assert leaks("gpu-box.lab.internal", inv) == ["the address of gpubox"]


@pytest.mark.parametrize("hostile, never", [
    ("H200 | injected | cell", re.compile(r"(?<!\\)\|")),                   # a pipe breaks a table row
    ("H200\n| --- |\n# heading", re.compile(r"\n")),                        # a newline starts a new block
    ("<img src=x onerror=alert(1)>", re.compile(r"(?<!\\)<")),              # raw HTML
    ("![x](http://evil.example/p.png)", re.compile(r"(?<!\\)!(?<!\\)\[|(?<!\\)\]\(")),  # remote image
    ("[click](https://evil.example)", re.compile(r"(?<!\\)\[")),            # link
    ("see http://evil.example/x", re.compile(r"(?<!\\)://")),               # bare autolink
    ("www.evil.example", re.compile(r"www\.")),
    ("\x1b[31mred\x1b[0m", re.compile("\x1b")),                             # terminal escapes
])
def test_md_escapes_host_strings(hostile: str, never: re.Pattern[str]) -> None:
    out = md(hostile)
    assert not never.search(out), out
    assert "\n" not in out


def test_plain_caps_and_redacts() -> None:
    out = plain("x" * 1000 + " 10.20.30.40")
    assert len(out) == 200 and out.endswith("…")
    assert plain("gpu at 10.20.30.40") == "gpu at [redacted]"
    assert md("NVIDIA H200 (driver 570.86)") == "NVIDIA H200 (driver 570.86)"
    assert md("`code` \\ $x$ mla_tree") == r"\`code\` \\ \$x\$ mla_tree"   # a trailing \ cannot eat a cell's |


@pytest.mark.parametrize("text, found", [("10.9.8.7.arrow", True), ("x.10.9.8.7", True), ("10.0.0.1.nip.io", True),
                                         ("1.2.3.4.5", False), ("version 2.13.0.1234", False)])
def test_ipv4_inside_names_but_not_longer_numbers(text: str, found: bool) -> None:
    assert ("an IPv4 address" in leaks(text)) is found


def test_fenced_output_cannot_close_its_block() -> None:
    out = fenced("ok\n```\n<img src=x>\n````` \x1b[2J")
    fence = out.splitlines()[0]
    assert set(fence) == {"`"} and len(fence) == 6 and out.endswith("\n" + fence)
    assert fence not in out[len(fence):-len(fence)] and "\x1b" not in out
