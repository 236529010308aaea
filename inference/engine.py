"""The node's engine interface: a session key, prompt tokens and sampling in; tokens and measurements out.

The rest of the product depends on this interface only; `inference.batch_engine`
implements it. The engine knows sessions and tokens, not conversations or users.
"""

import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

from inference.config import EngineConfig
from inference.engine_metrics import EngineMetrics
from inference.types import Generation, NodeStats, Sampling

if TYPE_CHECKING:
    from inference.chat_format import ChatFormat


class Engine(Protocol):
    name: str
    metrics: EngineMetrics  # totals since start, for Prometheus
    model: str  # the served model's name (inference.model_files)
    n_ctx: int
    chat_format: "ChatFormat"
    kv_store: str  # its disk tier's host and directory ("" without one)

    def default_sampling(self) -> Sampling: ...

    def generate(
        self,
        *,
        session_key: str,
        prompt: Sequence[int],
        sampling: Sampling,
        on_text: Callable[[str], bool] | None = None,
        stop: threading.Event | None = None,
    ) -> Generation: ...

    def stats(self) -> NodeStats: ...

    def session_places(self, limit: int) -> dict[str, str]:
        """Up to `limit` sessions this node holds, each with where: "resident", "ram" or "disk"."""
        ...

    def sessions_dropped(self) -> list[str]:
        """The sessions whose state left memory since the last call (for the heartbeat to report)."""
        ...

    def set_draining(self, draining: bool) -> None: ...

    def end_session(self, session_key: str) -> None: ...

    def close(self) -> None: ...


_engine: Engine | None = None
_engine_lock = threading.Lock()


def get_engine(config: EngineConfig | None = None) -> Engine:
    """The process's engine, loaded once (at node start, with `config`) and shared by all task threads."""
    global _engine
    with _engine_lock:
        if _engine is None:
            from inference.batch_engine import BatchEngine  # here: the web process never loads llama.cpp

            _engine = BatchEngine(config or EngineConfig())
        return _engine
