"""llama.cpp's OpenMP threads spin a third as long as libgomp's default before they sleep."""

import json
import os
import subprocess
import sys

from django.conf import settings


def _spin_count(env: dict[str, str]) -> str:
    """The spin count libgomp reports when the runtime module (and so llama.cpp) is first imported."""
    shown = subprocess.run(
        [sys.executable, "-c", "import inference.llama_runtime"],
        env=env | {"OMP_DISPLAY_ENV": "verbose"},
        cwd=settings.BASE_DIR,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stderr
    return next(line.split("=")[1].strip(" '") for line in shown.splitlines() if "GOMP_SPINCOUNT" in line)


def test_the_package_sets_the_spin_count_before_llama_cpp_loads():
    env = {k: v for k, v in os.environ.items() if k != "GOMP_SPINCOUNT"}
    assert _spin_count(env) == "100000"


def test_a_spin_count_from_the_environment_wins():
    assert _spin_count(os.environ | {"GOMP_SPINCOUNT": "2000"}) == "2000"


def _child_spin_count(env: dict[str, str]) -> str | None:
    """The spin count a program started by this package's process would inherit."""
    code = "import json, inference; print(json.dumps(inference.environment_for_children().get('GOMP_SPINCOUNT')))"
    shown = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=settings.BASE_DIR, capture_output=True, text=True, check=True
    ).stdout
    return json.loads(shown)


def test_a_child_process_applies_its_own_default_unless_the_environment_chose():
    # `bench_stack --baseline` starts another checkout's node from this process: it must apply that
    # checkout's default, not inherit this one's.
    env = {k: v for k, v in os.environ.items() if k != "GOMP_SPINCOUNT"}
    assert _child_spin_count(env) is None
    assert _child_spin_count(env | {"GOMP_SPINCOUNT": "2000"}) == "2000"
