"""A request the server refuses, and its error in each API's shape: OpenAI's (the default),
llama-server's for its native endpoints, and Anthropic's for the Messages API."""

from __future__ import annotations

from typing import Any

# Anthropic's error types by status
ANTHROPIC_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                         404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                         503: "overloaded_error"}
# llama-server's error types by status (its native endpoints answer them with the status as code)
LLAMA_ERROR_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
                     501: "not_supported_error", 503: "unavailable_error"}


class BadRequest(Exception):
    """A request the API refuses: its status, message, parameter and OpenAI error code; ``extra``
    fields go into the error object (llama-server's ``n_prompt_tokens`` and ``n_ctx`` of a prompt
    that does not fit)."""

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None, status: int = 400,
                 extra: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.message, self.param, self.code, self.status = message, param, code, status
        self.extra = extra or {}

    def body(self) -> dict[str, Any]:
        """OpenAI's error object."""
        kind = "authentication_error" if self.status == 401 else \
            "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code,
                          **self.extra}}

    def llama_body(self) -> dict[str, Any]:
        """llama-server's error object, for its native endpoints."""
        kind = "exceed_context_size_error" if self.code == "context_length_exceeded" else \
            LLAMA_ERROR_TYPES.get(self.status, "invalid_request_error" if self.status < 500 else "server_error")
        return {"error": {"code": self.status, "message": self.message, "type": kind, **self.extra}}

    def anthropic_body(self) -> dict[str, Any]:
        """Anthropic's error object, for the Messages API."""
        return {"type": "error", "error": {"type": ANTHROPIC_ERROR_TYPES.get(self.status, "api_error"),
                                           "message": self.message}}
