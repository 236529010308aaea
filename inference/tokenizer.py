"""The chat format without the weights: the web process counts tokens with a model's vocabulary only."""

import threading
from functools import cache

from inference.chat_format import ChatFormat, chat_format_for_model
from inference.model_files import ModelFile

_loading = threading.Lock()


def chat_format_for(model: ModelFile) -> ChatFormat:
    """One vocabulary per model and process. The lock matters: the load test found 32 first requests each
    loading their own copy (about 47 MiB each) before the cache held one."""
    with _loading:
        return _load(model)


@cache
def _load(model: ModelFile) -> ChatFormat:
    from llama_cpp import Llama

    vocabulary = Llama(model_path=str(model.path), vocab_only=True, verbose=False)
    template = vocabulary.metadata.get("tokenizer.chat_template", "")
    return chat_format_for_model(vocabulary, template=template, forced=model.chat_template)
