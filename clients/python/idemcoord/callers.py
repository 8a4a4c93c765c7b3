"""Keys that survive retries, for HTTP callers on requests (Debian's python3-requests).

    session = requests.Session()
    session.mount("https://", idemcoord.callers.IdempotencyKeyAdapter(max_retries=Retry(total=3, allowed_methods=None)))
    session.post("https://pay.example/charges", json=charge)  # one Idempotency-Key for every retry

IdempotencyKeyAdapter stamps an Idempotency-Key on each request it sends
(POST and PATCH by default) that has none, before urllib3's retries
(max_retries): every retry of that request carries the same key, so a
service behind idemcoord's middleware runs it once. stamp_idempotency_key
does the same to headers you send yourself: call it once, before your own
retry loop.
"""

import uuid
from typing import Any, Iterable, MutableMapping, Optional

import requests
import requests.adapters

from ._http import KEY_HEADER, parse_idempotency_key

__all__ = ["IdempotencyKeyAdapter", "stamp_idempotency_key"]


def stamp_idempotency_key(headers: MutableMapping[str, Any]) -> str:
    """Sets Idempotency-Key in headers (a new UUIDv4, as a structured-field string) when absent; returns the key.

    The key it returns is the new one, or the one headers had (parsed as the
    middlewares parse it; the raw value when it does not parse). headers is
    a requests.PreparedRequest's or a session's headers (case-insensitive),
    or a dict you pass as headers= on every attempt.
    """
    for name in list(headers):
        if name.lower() == KEY_HEADER.lower():
            had = headers[name]
            try:
                return str(parse_idempotency_key(had.encode("latin-1") if isinstance(had, str) else had))
            except ValueError:
                return str(had)
    key = str(uuid.uuid4())
    headers[KEY_HEADER] = '"%s"' % key
    return key


class IdempotencyKeyAdapter(requests.adapters.HTTPAdapter):
    """A requests HTTPAdapter that stamps one Idempotency-Key per request, the same on each of urllib3's retries.

    methods: the request methods it stamps (default POST and PATCH, the
    middlewares' default); other arguments are HTTPAdapter's (max_retries:
    an int or a urllib3 Retry).
    """

    def __init__(self, *args: Any, methods: Iterable[str] = ("POST", "PATCH"), **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.methods = frozenset(m.upper() for m in methods)

    def send(self, request: requests.PreparedRequest, *args: Any, **kwargs: Any) -> requests.Response:
        if (request.method or "").upper() in self.methods:
            stamp_idempotency_key(request.headers)
        response: requests.Response = super().send(request, *args, **kwargs)
        return response


def key_of(response: requests.Response) -> Optional[str]:
    """The Idempotency-Key the request of response carried, or None."""
    value = response.request.headers.get(KEY_HEADER)
    if value is None:
        return None
    try:
        return str(parse_idempotency_key(value.encode("latin-1") if isinstance(value, str) else value))
    except ValueError:
        return str(value)
