"""Domain errors the data layer raises; ``api`` maps each to one HTTP status."""

from __future__ import annotations

import math


class ServiceError(Exception):
    status_code = 400

    def __init__(self, message: str, *, field: str | None = None, item: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.field = field
        self.item = item  # a batch's refused item, by its index (the answer's ``item``)


class NotFound(ServiceError):
    status_code = 404


class Forbidden(ServiceError):
    status_code = 403


class Unauthorized(ServiceError):
    status_code = 401


class Conflict(ServiceError):
    """A compare-and-set write found the row changed, or an idempotency key was reused."""

    status_code = 409


class Invalid(ServiceError):
    status_code = 422


class PaymentRequired(ServiceError):
    """The tenant's balance does not cover the credit a request must reserve."""

    status_code = 402


class TransitionRejected(Conflict):
    """An allocation status change that the transition rules do not allow."""


class TooManyRequests(ServiceError):
    """A caller over its fair share (``service.fairness``): answered 429 with ``Retry-After``."""

    status_code = 429

    def __init__(self, message: str, *, retry_after: float) -> None:
        super().__init__(message)
        self.retry_after = max(1, math.ceil(retry_after))
