"""Which node serves a session. A placeholder: a stable hash over the configured nodes."""

import hashlib

from django.conf import settings


def node_for_session(*, session_key: str) -> str:
    """The node name for this session; the same key always maps to the same node."""
    nodes = settings.ROUTER_NODES
    digest = hashlib.blake2b(session_key.encode(), digest_size=8).digest()
    return nodes[int.from_bytes(digest) % len(nodes)]


def queue_for_node(name: str) -> str:
    return f"{settings.NODE_QUEUE_PREFIX}{name}"
