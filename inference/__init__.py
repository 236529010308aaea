"""The inference node's engine, on llama.cpp.

llama.cpp's CPU threads are an OpenMP team (libgomp). When a decode ends, libgomp keeps the idle
threads spinning 300,000 rounds (milliseconds) before they sleep: on a node that is all of the
engine's Python between two steps, a core taken from the web process, Postgres and the task threads.
10,000 rounds still cover the waits inside one decode. libgomp reads this once, when llama.cpp's
libraries load, and every import of llama_cpp here comes after this package's: it is set here, unless
the environment already chose.
"""

import os

# Whether the environment chose the spin count, rather than this package.
_SPIN_COUNT_CHOSEN = "GOMP_SPINCOUNT" in os.environ
os.environ.setdefault("GOMP_SPINCOUNT", "10000")


def environment_for_children() -> dict[str, str]:
    """This process's environment for a program it starts: without the spin count this package set, so
    that a node from another checkout (`bench_stack --baseline`) applies its own default, not this one's."""
    env = dict(os.environ)
    if not _SPIN_COUNT_CHOSEN:
        env.pop("GOMP_SPINCOUNT", None)
    return env
