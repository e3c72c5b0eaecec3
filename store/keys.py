"""API key material: random `sb-` keys, shown once; the store keeps only their sha256."""

import hashlib
import hmac
import secrets
import time

from store.models import ApiKeyRecord

KEY_PREFIX = "sb-"
_NUM_DISPLAY_CHARS = 8  # "sb-" and 5 random characters: enough to tell keys apart in a listing


def hash_key(plaintext: str) -> str:
    """The stored form of a key: hex sha256 of its text (keys are random, so no salt is needed)."""
    return hashlib.sha256(plaintext.encode()).hexdigest()


def verify_key(plaintext: str, key_hash: str) -> bool:
    """Whether `plaintext` hashes to `key_hash`, compared in constant time."""
    return hmac.compare_digest(hash_key(plaintext), key_hash)


def new_key(tenant: str, now: float | None = None) -> tuple[ApiKeyRecord, str]:
    """A fresh key for `tenant`: its record (hash only) and its plaintext, to be shown once."""
    plaintext = KEY_PREFIX + secrets.token_urlsafe(32)
    record = ApiKeyRecord(
        id="key_" + secrets.token_hex(8),
        tenant=tenant,
        prefix=plaintext[:_NUM_DISPLAY_CHARS],
        key_hash=hash_key(plaintext),
        created_at=time.time() if now is None else now,
    )
    return record, plaintext
