"""API keys for a server used by more than one person: ``serve.keys_file``.

The file is JSON, owner-only (mode 0600 or 0400, owned by the user who starts the server)::

    {"keys": [{"name": "alice", "sha256": "<hex digest of the key>", "runs": ["exp-*"]},
              {"name": "ci-bot", "key": "<the key itself>", "runs": ["*"]}]}

Each key has a name (shown in the access log and the run's audit trail, never the key itself), the key
or its sha256 (``printf %s KEY | sha256sum``: the file then holds no usable secret), and the runs it may
use: shell-style patterns matched against the served model's id (the run directory's name). A request
with a known key whose ``runs`` do not cover the served run is answered 403; an unknown key 401.
Keys are compared as sha256 digests with :func:`hmac.compare_digest`, so timing says nothing of them.
"""

from __future__ import annotations

import fnmatch
import hashlib
import hmac
import json
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from xirang_hpc.config.errors import ConfigError

MIN_KEY_CHARS = 16


@dataclass(frozen=True)
class Key:
    """One named key: the sha256 of its secret and the run patterns it may use."""

    name: str
    digest: bytes
    runs: tuple[str, ...]

    def may_serve(self, model_id: str) -> bool:
        """Whether this key may use the server of ``model_id`` (the served run's name)."""
        return any(fnmatch.fnmatchcase(model_id, pattern) for pattern in self.runs)


def _digest(secret: str) -> bytes:
    return hashlib.sha256(secret.encode()).digest()


class Keys:
    """The keys a server accepts (from ``serve.keys_file`` and/or the single bearer token)."""

    def __init__(self, keys: list[Key]) -> None:
        self.keys = keys

    def __bool__(self) -> bool:
        return bool(self.keys)

    @classmethod
    def from_token(cls, token: str | None) -> Keys:
        """The single ``$XIRANG_SERVE_TOKEN`` bearer token as a key named ``token`` that may serve any run."""
        return cls([Key("token", _digest(token), ("*",))] if token else [])

    @classmethod
    def load(cls, path: str | Path, token: str | None = None) -> Keys:
        """Read and check a keys file (plus the optional single token); raise :class:`ConfigError` naming the
        problem: a file others can read or write, another owner, bad JSON, a missing field, a short key."""
        field = "serve.keys_file"
        p = Path(path)
        try:
            st = p.stat()
            raw = p.read_text()
        except OSError as exc:
            raise ConfigError(field, str(p), f"cannot read it ({exc.strerror}); point it at your keys file") from None
        if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise ConfigError(field, str(p), f"is mode {stat.S_IMODE(st.st_mode):04o}: a keys file must be readable "
                              f"by its owner only; run `chmod 600 {p}`")
        if st.st_uid != os.getuid():
            raise ConfigError(field, str(p), f"belongs to uid {st.st_uid}, not to you (uid {os.getuid()}): "
                              "someone else could change who may use your server; use a file you own")
        try:
            doc = json.loads(raw)
        except ValueError as exc:
            raise ConfigError(field, str(p), f"is not JSON ({exc}); see docs/security-and-sharing.md") from None
        entries = doc.get("keys") if isinstance(doc, dict) else None
        if not isinstance(entries, list) or not entries:
            raise ConfigError(field, str(p), 'needs {"keys": [{"name": ..., "key" or "sha256": ..., "runs": [...]}]}')
        keys: list[Key] = [] if not token else list(cls.from_token(token).keys)
        for i, e in enumerate(entries):
            where = f"{p}: keys[{i}]"
            if not isinstance(e, dict) or not isinstance(e.get("name"), str) or not e["name"]:
                raise ConfigError(field, where, "each key needs a non-empty 'name'")
            name = e["name"]
            if any(k.name == name for k in keys):
                raise ConfigError(field, where, f"the name {name!r} is used twice; names identify keys in the logs")
            if isinstance(e.get("key"), str):
                if len(e["key"]) < MIN_KEY_CHARS:
                    raise ConfigError(field, where, f"key {name!r} is shorter than {MIN_KEY_CHARS} characters; "
                                      "generate one with `openssl rand -hex 32`")
                digest = _digest(e["key"])
            elif isinstance(e.get("sha256"), str):
                try:
                    digest = bytes.fromhex(e["sha256"])
                except ValueError:
                    digest = b""
                if len(digest) != 32:
                    raise ConfigError(field, where, f"key {name!r}: 'sha256' must be 64 hex digits "
                                      "(`printf %s KEY | sha256sum`)")
            else:
                raise ConfigError(field, where, f"key {name!r} needs 'key' (the secret) or 'sha256' (its digest)")
            runs = e.get("runs")
            if not isinstance(runs, list) or not runs or not all(isinstance(r, str) and r for r in runs):
                raise ConfigError(field, where, f"key {name!r} needs 'runs': a list of run names or patterns "
                                  '(["*"] for every run)')
            keys.append(Key(name, digest, tuple(runs)))
        return cls(keys)

    def match(self, authorization: str) -> Key | None:
        """The key an ``Authorization: Bearer <key>`` header carries, or None (every key is compared)."""
        scheme, _, secret = authorization.partition(" ")
        got = _digest(secret.strip()) if scheme.lower() == "bearer" and secret.strip() else b"\0" * 32
        found = None
        for k in self.keys:  # no early exit: the time taken does not depend on which key matched
            if hmac.compare_digest(got, k.digest):
                found = k
        return found
