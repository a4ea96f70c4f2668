"""Per-attempt upload tokens: signed attempt lease ids, so that none is stored and each names its attempt."""

from django.core import signing

_SALT = "simpletuner.artifacts.upload-token.v1"
PREFIX = "stu_"


def upload_token(lease_id):
    """Return the upload token of the attempt holding lease ``lease_id``."""
    return PREFIX + signing.Signer(salt=_SALT).sign(lease_id)


def token_lease(token):
    """Return the lease id ``token`` was issued for, or None when it is not a token we signed."""
    if not isinstance(token, str) or not token.startswith(PREFIX) or len(token) > 200:
        return None
    try:
        return signing.Signer(salt=_SALT).unsign(token[len(PREFIX) :])
    except signing.BadSignature:
        return None
