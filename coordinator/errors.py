"""Domain errors. Servicers map each to a gRPC status; the message goes to the caller as is,
so it must say what was wrong without leaking internals."""

from __future__ import annotations


class FedraError(Exception):
    """Base: a request the coordinator refuses, with a message for the caller."""


class InvalidArgument(FedraError):
    """The request itself is malformed: bad spec, bad payload, wrong shapes, non-finite values."""


class NotFound(FedraError):
    """An unknown run, task, site or checkpoint."""


class FailedPrecondition(FedraError):
    """Valid, but not now: a closed round, a finished run, a straggler's late update."""


class AlreadyExists(FedraError):
    """A second update for the same task, or a reused nonce."""


class PermissionDenied(FedraError):
    """A site acting for another site or on a task it was not given."""


class ResourceExhausted(FedraError):
    """Too large: a payload larger than the model it claims to update, a reply larger
    than a message may be."""


class Unauthenticated(FedraError):
    """No verified identity, a revoked certificate, or a bad upload signature."""


class Unavailable(FedraError):
    """The coordinator cannot serve the call right now (e.g. its deny list is unreadable)."""
