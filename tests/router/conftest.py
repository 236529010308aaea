import pytest

from router.models import Node
from tests.factories import NodeFactory


@pytest.fixture
def nodes(db) -> list[Node]:
    """Three healthy nodes, and no others (a test node process may have registered itself)."""
    Node.objects.update(status=Node.Status.DOWN)
    return [NodeFactory.create(name=f"n{i}") for i in range(3)]
