"""``spotgpu node reclaim|drain|live``, run as a provider would, against the real service."""

from __future__ import annotations

from conftest import one_database
from test_access_cli import _env
from test_cli import spotgpu


@one_database("the CLI's rendering of the API's replies")
def test_a_provider_reclaims_drains_and_offers_its_node_by_name(service):
    owner, buyer, stranger = service.tenant(), service.tenant(), service.tenant()
    node, _ = service.node(owner, gpus=2, reserve=0.5, name="rack-7")
    bid = buyer.post("/bids", json={"gpu_model": "A100-80G", "gpu_count": 1, "max_price": 1.0})
    bid = bid.json()
    service.wait_for(lambda: buyer.get(f"/bids/{bid['id']}/allocations").json())
    key = owner.headers["Authorization"].removeprefix("Bearer ")
    env = _env(service, SPOTGPU_API_KEY=key)
    out = spotgpu("node", "reclaim", "rack-7", env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"node {node['id']} (rack-7): live -> reclaimed" in out.stdout
    assert "1 of 2 GPUs in use" in out.stdout and "notice" in out.stdout
    (alloc,) = buyer.get(f"/bids/{bid['id']}/allocations").json()
    service.wait_for(lambda: buyer.get(f"/allocations/{alloc['id']}").json()["status"] == "noticed")
    out = spotgpu("node", "live", str(node["id"]), env=env)
    assert out.returncode == 0 and "reclaimed -> live" in out.stdout, out.stdout + out.stderr
    out = spotgpu("node", "drain", "rack-7", env=env)
    assert out.returncode == 0 and "live -> draining" in out.stdout
    # another tenant's node is not yours: named like yours, refused, nothing changed
    other = stranger.headers["Authorization"].removeprefix("Bearer ")
    out = spotgpu("node", "reclaim", "rack-7", env=_env(service, SPOTGPU_API_KEY=other))
    assert out.returncode == 1 and "you have no node 'rack-7'" in out.stdout
    assert owner.get(f"/nodes/{node['id']}").json()["state"] == "draining"
    out = spotgpu("node", "reclaim", "nope", env=env)
    assert out.returncode == 1 and f"yours: {node['id']} (rack-7)" in out.stdout
