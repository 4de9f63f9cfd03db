"""OpenAI's error shape, {"error": {"message", "type", "param", "code"}}, and the HTTP statuses the server
answers with: 400 for bad input (naming the field in `param`), 404 for an unknown model, 429 when the bounded
queue is full, 503 while shutting down, 500 for a request the engine failed."""

from __future__ import annotations

import re

from fastapi.responses import JSONResponse

# The type OpenAI's API gives each status; clients (the openai package) pick their exception by status.
ERROR_TYPES = {400: "invalid_request_error", 404: "invalid_request_error", 429: "rate_limit_error",
               500: "server_error", 503: "service_unavailable"}


class APIError(Exception):
    """An error answered as OpenAI's error body. `param`: the request field at fault (None: none is)."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": ERROR_TYPES[self.status], "param": self.param,
                          "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {"Retry-After": "1"} if self.status == 429 else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def bad_request(message: str, param: str | None) -> APIError:
    return APIError(400, message, param)


def from_sampling_error(err: ValueError, renames: dict[str, str] | None = None) -> APIError:
    """A ValueError of SamplingParams or the engine's checks ("SamplingParams.top_p must be ...") as a 400
    naming the request field; `renames` maps a SamplingParams name to the field's (chat's top_logprobs)."""
    message = str(err)
    found = re.search(r"SamplingParams\.(\w+)", message)
    param = found.group(1) if found else None
    if param is not None:
        param = (renames or {}).get(param, param)
        message = message.replace(f"SamplingParams.{found.group(1)}", param)
    return bad_request(message, param)
