"""An agent's word on its own presence (service/routes/presence.py), on both databases: a
leave reclaims its node and notices its running allocation; its return offers the node as it
was. An agent never undoes its owner's word (a reclaim, a drain, a lost provider role), and a
node token acts only for its own node."""

from __future__ import annotations

from test_service_api import wait_event


def state(service, node) -> str:
    return service.admin.get(f"/nodes/{node['id']}").json()["state"]


def test_an_agent_leaves_and_comes_back_as_its_node_was(service):
    owner, buyer = service.tenant(), service.tenant()
    node, agent = service.node(owner, gpus=8)
    bid = buyer.post(
        "/bids", json={"gpu_model": "A100-80G", "gpu_count": 8, "max_price": 1.2}
    ).json()
    wait_event(buyer, f"/bids/{bid['id']}/events", "allocated")
    assert agent.post(f"/nodes/{node['id']}/leave").json()["state"] == "reclaimed"
    notice = wait_event(buyer, f"/bids/{bid['id']}/events", "noticed")
    assert notice["payload"]["reason"] == "reclaimed"
    assert agent.post(f"/nodes/{node['id']}/back").json()["state"] == "live"
    # a drained node left and back is drained again
    assert owner.patch(f"/nodes/{node['id']}", json={"state": "draining"}).status_code == 200
    agent.post(f"/nodes/{node['id']}/leave")
    assert state(service, node) == "reclaimed"
    assert agent.post(f"/nodes/{node['id']}/back").json()["state"] == "draining"


def test_an_agent_never_undoes_its_owners_word(service):
    owner = service.tenant()
    node, agent = service.node(owner, gpus=8)
    other, _ = service.node(service.tenant(), gpus=8)  # another provider's
    # the owner's reclaim, before or after the agent's leave, outlives the agent's return
    assert owner.patch(f"/nodes/{node['id']}", json={"state": "reclaimed"}).status_code == 200
    assert agent.post(f"/nodes/{node['id']}/back").json()["state"] == "reclaimed"
    assert owner.patch(f"/nodes/{node['id']}", json={"state": "live"}).status_code == 200
    agent.post(f"/nodes/{node['id']}/leave")
    assert owner.patch(f"/nodes/{node['id']}", json={"state": "reclaimed"}).status_code == 200
    assert agent.post(f"/nodes/{node['id']}/back").json()["state"] == "reclaimed"
    # a former provider's node does not come back live
    assert owner.patch(f"/nodes/{node['id']}", json={"state": "live"}).status_code == 200
    agent.post(f"/nodes/{node['id']}/leave")
    revoked = service.admin.put(f"/tenants/{owner.tenant_id}/provider", json={"provider": False})
    assert revoked.status_code == 200
    assert agent.post(f"/nodes/{node['id']}/back").json()["state"] == "draining"
    # a node token speaks for its own node only; a tenant key for none
    for path in ("leave", "back"):
        assert agent.post(f"/nodes/{other['id']}/{path}").status_code == 403
        assert owner.post(f"/nodes/{node['id']}/{path}").status_code == 403
    assert state(service, other) == "live"
