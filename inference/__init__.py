"""The inference node's engine, on llama.cpp.

llama.cpp's CPU threads are an OpenMP team (libgomp). A thread that waits, at a barrier inside a decode
or for the next decode, spins before it sleeps: libgomp's default, 300,000 rounds (milliseconds), holds a
core through the engine's Python between two steps, a core the web process, Postgres and the task
threads need. Too short a spin (10,000 until session 42) puts a thread to sleep at a barrier whenever
its partner is preempted for a moment, and its core stays idle until it is woken: 5% of a replay. At
100,000 rounds the machine stood idle 1.5% (the README's settings table has the A/B). libgomp reads this
once, when llama.cpp's libraries load, and every import of llama_cpp here comes after this package's: it
is set here, unless the environment already chose.
"""

import os

# Whether the environment chose the spin count, rather than this package.
_SPIN_COUNT_CHOSEN = "GOMP_SPINCOUNT" in os.environ
os.environ.setdefault("GOMP_SPINCOUNT", "100000")


def environment_for_children() -> dict[str, str]:
    """This process's environment for a program it starts: without the spin count this package set, so
    that a node from another checkout (`bench_stack --baseline`) applies its own default, not this one's."""
    env = dict(os.environ)
    if not _SPIN_COUNT_CHOSEN:
        env.pop("GOMP_SPINCOUNT", None)
    return env
