"""Why a use case refused a request: a stable ``code``, a message for people, details for machines."""

from __future__ import annotations


class Refused(Exception):
    """The request is well-formed but cannot be done with these faces (the gateway answers 422)."""

    def __init__(self, message: str, code: str, **details: object) -> None:
        super().__init__(message)
        self.message, self.code, self.details = message, code, details
