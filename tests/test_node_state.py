"""What a dead trainer rank's stop says of its node: lost once Ray has declared it dead, or as soon
as its raylet refuses connections (Ray's declaration waits for missed heartbeats); maybe lost when
the raylet does not answer in time; nothing when it still answers (the rank died alone)."""

import socket

from ray_forge.cluster.nodes import state as _node_state


def _node(port: int, alive: bool = True) -> dict:
    return {"NodeID": "ab" * 28, "Alive": alive, "NodeManagerAddress": "127.0.0.1", "NodeManagerPort": port}


def test_a_node_ray_declared_dead_is_lost():
    assert _node_state(_node(1, alive=False)) == ", lost"


def test_a_node_whose_raylet_answers_is_not_called_lost():
    with socket.create_server(("127.0.0.1", 0)) as server:
        assert _node_state(_node(server.getsockname()[1])) == ""


def test_a_node_whose_raylet_refuses_connections_is_lost_before_ray_says_so():
    with socket.socket() as bound:  # bound, not listening: a connection to it is refused, and no one else gets the port
        bound.bind(("127.0.0.1", 0))
        assert _node_state(_node(bound.getsockname()[1])) == ", lost: its raylet refuses connections"


def test_a_raylet_that_does_not_answer_in_time_is_not_called_lost(monkeypatch):
    def no_answer(address, timeout):
        raise TimeoutError("timed out")

    monkeypatch.setattr(socket, "create_connection", no_answer)
    assert _node_state(_node(1), timeout_s=2.0) == ", its raylet does not answer within 2s: lost or overloaded"


def test_a_node_ray_does_not_list_adds_nothing():
    assert _node_state({}) == ""


def test_a_cluster_joined_again_after_a_replacement_waits_for_its_running_nodes_by_raylet_port(monkeypatch):
    """``LocalCluster.connect`` after a node was killed and replaced at the same address: Ray may
    list the killed node dead or still alive, beside its replacement; either way the running
    nodes, told apart by their raylets' ports, are what it waits for (counting every node ever
    started waited for one Ray had declared dead: test_node_loss, under load)."""
    import subprocess

    import pytest
    import ray

    from ray_forge.cluster.local import LocalCluster, NodeSpec

    cluster = LocalCluster([NodeSpec("127.0.0.2", num_cpus=1), NodeSpec("127.0.0.3", num_cpus=1)], start_timeout_s=1)
    running, killed = subprocess.Popen(["sleep", "30"]), subprocess.Popen(["true"])
    killed.wait()
    cluster.nodes.append(cluster.nodes[1])
    cluster.procs, cluster.manager_ports = [running, killed, running], [101, 102, 103]
    table = {"declared": [_node(101), _node(102, alive=False), _node(103)],
             "not yet declared": [_node(101), _node(102), _node(103)],
             "replacement not up": [_node(101), _node(102, alive=False)]}
    for nodes in table.values():
        for node, ip in zip(nodes, ("127.0.0.2", "127.0.0.3", "127.0.0.3")):
            node["NodeManagerAddress"] = ip
    try:
        for case in ("declared", "not yet declared"):
            monkeypatch.setattr(ray, "nodes", lambda: table[case])
            cluster._wait_for_running()  # returns at once
        monkeypatch.setattr(ray, "nodes", lambda: table["replacement not up"])
        with pytest.raises(TimeoutError, match=r"Ray does not count nodes \[2\] alive"):
            cluster._wait_for_running()
    finally:
        running.kill()
