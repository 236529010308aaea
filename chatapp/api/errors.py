"""Errors in OpenAI's format: {"error": {"message", "type", "param", "code"}} with the matching status."""

from django.http import JsonResponse


class ApiError(Exception):
    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message, self.status, self.type, self.param, self.code = message, status, type, param, code
        self.headers = headers or {}

    def response_body(self) -> dict:
        return {"message": self.message, "type": self.type, "param": self.param, "code": self.code}

    def response(self) -> JsonResponse:
        from chatapp import metrics  # imports the router and Redis, which the API's error type need not load

        metrics.count("api_errors_total", self.code or str(self.status))
        response = JsonResponse({"error": self.response_body()}, status=self.status)
        for name, value in self.headers.items():
            response[name] = value
        return response
