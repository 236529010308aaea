"""The router's admin pages on real Postgres."""

from django.urls import reverse

from router.models import Node
from tests.factories import NodeFactory


def test_the_node_list_shows_each_nodes_disk_tier(admin_client):
    Node.objects.all().delete()
    NodeFactory.create(name="with-disk", kv_store="host:/kv", stats={"disk_sessions": 3, "disk_bytes": 48 * 2**20})
    NodeFactory.create(name="without-disk", kv_store="")
    page = admin_client.get(reverse("admin:router_node_changelist")).content.decode()
    assert "3 sessions, 48 MiB" in page
    row = next(r for r in page.split("<tr") if ">without-disk</a>" in r)
    assert '<td class="field-on_disk">off</td>' in row
