"""The chat format without the weights: the web process counts tokens with the model's vocabulary only."""

from functools import cache

from inference.chat_format import GemmaChatFormat
from inference.model_files import resolve_model_path


@cache
def chat_format_for(model_path: str) -> GemmaChatFormat:
    from llama_cpp import Llama

    return GemmaChatFormat(Llama(model_path=str(resolve_model_path(model_path)), vocab_only=True, verbose=False))
