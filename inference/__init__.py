"""The inference node's engine, on llama.cpp.

llama.cpp's CPU threads are an OpenMP team (libgomp). When a decode ends, libgomp keeps the idle
threads spinning 300,000 rounds (milliseconds) before they sleep: on a node that is all of the
engine's Python between two steps, a core taken from the web process, Postgres and the task threads.
10,000 rounds still cover the waits inside one decode. libgomp reads this once, when llama.cpp's
libraries load, and every import of llama_cpp here comes after this package's: it is set here, unless
the environment already chose.
"""

import os

os.environ.setdefault("GOMP_SPINCOUNT", "10000")
