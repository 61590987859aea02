"""Who an actor of the fleet is: a role and an index, never a string to take apart.

Ray knows each actor by ``str(actor_id)`` (``policy-0``, ``env-3``, ``trainer-1``); logs, errors,
metrics and the weight store's rendezvous print the same. Only this module writes that name, and
nothing reads one back: whoever needs the role or the index holds the id.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Role(str, Enum):
    POLICY = "policy"
    ENV = "env"
    TRAINER = "trainer"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True, order=True)
class ActorId:
    role: Role
    index: int

    def __str__(self) -> str:
        return f"{self.role.value}-{self.index}"

    def matches(self, targets: tuple[str, ...]) -> bool:
        """Whether a config's list of actors names this one, by its role (``env``) or itself (``policy-1``)."""
        return self.role.value in targets or str(self) in targets


def policy(index: int) -> ActorId:
    return ActorId(Role.POLICY, index)


def env(index: int) -> ActorId:
    return ActorId(Role.ENV, index)


def trainer(rank: int) -> ActorId:
    return ActorId(Role.TRAINER, rank)


def all_of(role: Role, count: int) -> list[ActorId]:
    """The ids of ``count`` actors of ``role``, index 0 first."""
    return [ActorId(role, i) for i in range(count)]
