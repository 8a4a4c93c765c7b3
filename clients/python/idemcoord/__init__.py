"""idemcoord: the Python client of the idemcoord idempotency coordinator.

    import idemcoord

    with idemcoord.Client("127.0.0.1:50051", token="...") as client:
        key = idemcoord.dedup_key("create-project", user_id, None, name)
        result = client.once("projects.create", key, fingerprint, create)

See Client, Client.once, mark_side_effect, checkpoint and dedup_key. Messages are the
protobuf classes of the API's descriptor set (StoredResponse, Record, ...);
State, Outcome and FailureKind are its enums.
"""

from ._api import REASONS, FailureKind, Outcome, Record, State, StoredResponse
from .client import Attempt, Checkpoint, Client, Lease, Result, checkpoint, checkpoint_from, current_lease, mark_side_effect
from .dedup import dedup_key, normalize_name
from .errors import (CONTENT_TYPE_PROTO, REASON_UNKNOWN_HELD, SCHEMA_VERSION_STATUS, FailureError, GuardsNothingWarning,
                     LeaseLost,
                     LeaseUnconfirmed, StoredFailure, UndecidedPrincipalWarning, UnknownHeld, UnnamedServiceWarning)

__all__ = [
    "Attempt", "Checkpoint", "Client", "CONTENT_TYPE_PROTO", "FailureError", "FailureKind", "GuardsNothingWarning", "Lease",
    "LeaseLost", "LeaseUnconfirmed",
    "Outcome", "REASON_UNKNOWN_HELD", "REASONS", "Record", "Result", "SCHEMA_VERSION_STATUS", "State", "StoredFailure",
    "StoredResponse", "UndecidedPrincipalWarning", "UnknownHeld", "UnnamedServiceWarning", "checkpoint", "checkpoint_from",
    "current_lease", "dedup_key",
    "mark_side_effect", "normalize_name",
]
