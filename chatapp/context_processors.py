from django.http import HttpRequest

from inference.config import EngineConfig


def engine_limits(request: HttpRequest) -> dict:
    """What pages show about the model's limits (the context bar in the turn inspector)."""
    return {"n_ctx": EngineConfig().N_CTX}
