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
