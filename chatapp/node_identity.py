"""This process's incarnation: a node restarted under the same name is a new process with a new id, so
the turns its predecessor claimed can be told from its own."""

import uuid
from functools import cache


@cache
def incarnation() -> str:
    return uuid.uuid4().hex
