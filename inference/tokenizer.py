"""The chat format without the weights: the web process counts tokens with the model's vocabulary only."""

import threading
from functools import cache

from inference.chat_format import GemmaChatFormat
from inference.model_files import resolve_model_path

_loading = threading.Lock()


def chat_format_for(model_path: str) -> GemmaChatFormat:
    """One vocabulary per process. The lock matters: the load test found 32 first requests each loading
    their own copy (about 47 MiB each) before the cache held one."""
    with _loading:
        return _load(model_path)


@cache
def _load(model_path: str) -> GemmaChatFormat:
    from llama_cpp import Llama

    return GemmaChatFormat(Llama(model_path=str(resolve_model_path(model_path)), vocab_only=True, verbose=False))
