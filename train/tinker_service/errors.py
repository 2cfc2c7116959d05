"""The one error type for a request the client got wrong: the service fails that request alone (a 400 at
submission, or a failed future with category "user"), and the message names the datum, field or key."""
from __future__ import annotations


class ClientError(ValueError):
    pass
