"""OpenSSH public keys as the inventory pins them: parse a key line, its SHA256 fingerprint, and back."""

from __future__ import annotations

import base64
import hashlib

import paramiko


def parse_public_key(line: str) -> paramiko.PKey:
    """An OpenSSH public key line ("ssh-ed25519 AAAA... [comment]") as a paramiko key."""
    parts = line.split()
    if len(parts) < 2:
        raise ValueError("not an OpenSSH public key line ('TYPE BASE64')")
    try:
        blob = base64.b64decode(parts[1], validate=True)
        return paramiko.PKey.from_type_string(parts[0], blob)
    except Exception as e:  # paramiko raises several unrelated types for bad blobs
        raise ValueError(f"not a valid {parts[0]} public key ({type(e).__name__})") from None


def fingerprint(key: paramiko.PKey) -> str:
    """`SHA256:<base64>` of the key blob, the form OpenSSH shows."""
    digest = hashlib.sha256(key.asbytes()).digest()
    return "SHA256:" + base64.b64encode(digest).decode().rstrip("=")


def key_line(key: paramiko.PKey) -> str:
    """The key as it is pinned in a host file."""
    return f"{key.get_name()} {key.get_base64()}"
