"""The one error shape every gatewayd route answers with.

    {"error": {"message": "...", "type": "invalid_request_error", "param": null,
               "code": "EINVAL"}}

It is OpenAI's error body (so OpenAI clients show the message), with `code` an errno
name as everywhere else in Symphony (`model_not_found` and `invalid_api_key` where an
OpenAI client expects those). An `ApiError` raised anywhere below a route becomes this
body with its HTTP status; any other exception becomes a 500 with EIO.
"""
from __future__ import annotations

from dataclasses import dataclass

TYPES = {400: "invalid_request_error", 401: "authentication_error",
         403: "permission_error", 404: "not_found_error", 409: "conflict_error",
         413: "invalid_request_error", 429: "rate_limit_error", 503: "service_unavailable"}


@dataclass
class ApiError(Exception):
    status: int
    code: str
    message: str
    param: str | None = None

    def body(self) -> dict:
        return error_body(self.status, self.code, self.message, self.param)


def error_body(status: int, code: str, message: str, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": TYPES.get(status, "server_error"),
                      "param": param, "code": code}}
