"""The server's errors: OpenAI's JSON shape ``{"error": {"message", "type", "param", "code"}}``, and
FastAPI's validation errors (a 422 of its own shape) turned into it."""

from __future__ import annotations

from fastapi.responses import JSONResponse


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def response(self) -> JSONResponse:
        return JSONResponse({"error": {"message": self.message, "type": self.kind, "param": self.param,
                                       "code": self.code}}, status_code=self.status)


def unknown_model(name: str, served: str, param: str | None = "model") -> ApiError:
    return ApiError(404, f"model {name!r} does not exist: this server serves {served!r}.", param, "model_not_found")


def validation_error(errors: list[dict]) -> ApiError:
    """OpenAI's 400 for FastAPI's validation errors (its default is a 422 with another shape)."""
    first = errors[0] if errors else {"type": "", "loc": (), "msg": "invalid request"}
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    param = loc[0] if loc else None
    kind = first.get("type")
    if kind == "json_invalid":
        why = first.get("ctx", {}).get("error") or first["msg"]
        return ApiError(400, f"the request body is not valid JSON ({why}): send a JSON object.")
    if param is None:
        return ApiError(400, f"the request body must be a JSON object of the request's fields, sent with "
                        f"Content-Type: application/json ({first['msg']}).")
    if kind == "missing":
        return ApiError(400, f"{param} is required.", param)
    if kind == "extra_forbidden":
        return ApiError(400, f"unrecognized request argument supplied: {'.'.join(loc)} (see docs/inference.md for "
                        "the fields).", param)
    shown = repr(first.get("input"))
    shown = shown if len(shown) <= 60 else shown[:57] + "..."
    return ApiError(400, f"{'.'.join(loc)} is invalid: {first['msg'][0].lower()}{first['msg'][1:]}, got {shown}.",
                    param)
