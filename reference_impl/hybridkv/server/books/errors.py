"""The one exception a handler raises to refuse a request."""

from __future__ import annotations

from hybridkv.wire.protocol import ErrorCode


class RequestError(Exception):
    """A request the server refuses; becomes an Error reply, and the server keeps serving."""

    def __init__(self, code: ErrorCode, message: str):
        super().__init__(message)
        self.code = code
        self.message = message
