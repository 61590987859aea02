"""What a dead trainer rank's stop says of its node: lost once Ray has declared it dead, or as soon
as its raylet takes no connection (Ray's declaration waits for missed heartbeats), and nothing when
the raylet still answers (the rank died alone)."""

import socket

from ray_forge.actors.trainer_group import _node_state


def _node(port: int, alive: bool = True) -> dict:
    return {"NodeID": "ab" * 28, "Alive": alive, "NodeManagerAddress": "127.0.0.1", "NodeManagerPort": port}


def test_a_node_ray_declared_dead_is_lost():
    assert _node_state(_node(1, alive=False)) == ", lost"


def test_a_node_whose_raylet_answers_is_not_called_lost():
    with socket.create_server(("127.0.0.1", 0)) as server:
        assert _node_state(_node(server.getsockname()[1])) == ""


def test_a_node_whose_raylet_takes_no_connection_is_lost_before_ray_says_so():
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
    assert _node_state(_node(port)) == ", lost: its raylet takes no connection"  # the port is closed now


def test_a_node_ray_does_not_list_adds_nothing():
    assert _node_state({}) == ""
