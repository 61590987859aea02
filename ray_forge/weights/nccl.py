"""GPU transport: trainer rank 0 broadcasts straight into every vLLM worker over NCCL.

This is a push, through vLLM's own weight-transfer API (``weight_transfer_config`` backend
"nccl" on the engine, ``NCCLTrainerWeightTransferEngine`` on the trainer): the put drives the
receivers, so the policies' later "get" only confirms the version was published.

UNTESTED: it needs CUDA and NCCL, which the CPU machines this project is developed on do not
have. The CPU transports (shm, object_store) carry every test.
"""

from __future__ import annotations

import concurrent.futures
import socket
from typing import Iterator

import ray
import torch

from ray_forge.weights.base import Manifest, StoreSpec, TransportUnavailable, WeightSyncError
from ray_forge.weights.layout import Bucket, wire_dtype


class _PolicyClient:
    """vLLM's weight-sync client protocol, answered by our policy actors (each forwards to its engine)."""

    def __init__(self, handles: list, timeout_s: float) -> None:
        self.handles, self.timeout_s = handles, timeout_s

    def _all(self, method: str, *args) -> None:
        refs = [h.weight_transfer_rpc.remote(method, *args) for h in self.handles]
        ray.get(refs, timeout=self.timeout_s)

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self._all("init_weight_transfer_engine", init_info)

    def start_weight_update(self) -> None:
        self._all("start_weight_update")

    def update_weights(self, update_info: dict) -> None:
        self._all("update_weights", update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._all("finish_weight_update")


def _dict_source(dtype: str):
    from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

    class DictSource(WeightSource):
        """The state dict of the version being pushed, converted to the wire dtype."""

        state_dict: dict[str, torch.Tensor] = {}

        def metadata(self) -> list:
            return [ParamMeta(k, wire_dtype(v, dtype), tuple(v.shape)) for k, v in self.state_dict.items()]

        def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
            for k, v in self.state_dict.items():
                yield k, v.to(device="cuda", dtype=wire_dtype(v, dtype), non_blocking=True)

    return DictSource()


class NcclPushTransport:
    def __init__(self, spec: StoreSpec) -> None:
        if not torch.cuda.is_available():
            raise TransportUnavailable("weights.transport=nccl needs CUDA GPUs; on CPU use shm or object_store")
        self.spec = spec
        self.engine = self.source = None

    def _connect(self) -> None:
        from vllm.distributed.weight_transfer.nccl_engine import (NCCLTrainerInitInfo,
                                                                   NCCLTrainerWeightTransferEngine)

        handles = [ray.get_actor(name) for name in self.spec.receivers]
        workers = sum(ray.get([h.num_workers.remote() for h in handles], timeout=self.spec.timeout_s))
        with socket.socket() as sock:
            sock.bind(("", 0))
            port = sock.getsockname()[1]
        info = NCCLTrainerInitInfo(master_address=ray.util.get_node_ip_address(), master_port=port,
                                   world_size=1 + workers, rank=0)
        self.source = _dict_source(self.spec.dtype)
        self.engine = NCCLTrainerWeightTransferEngine.trainer_init(
            info, client=_PolicyClient(handles, self.spec.timeout_s), source=self.source)

    def write(self, version: int, buckets: list[Bucket], state_dict: dict[str, torch.Tensor]) -> None:
        if self.engine is None:
            self._connect()
        self.source.state_dict = state_dict
        # A broadcast to a dead peer never returns; bound it so the trainer is not held forever.
        pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
        try:
            pool.submit(self.engine.send_weights).result(timeout=self.spec.timeout_s)
        except concurrent.futures.TimeoutError:
            raise WeightSyncError(f"NCCL broadcast of weights version {version} from {self.spec.sender} to "
                                  f"{list(self.spec.receivers)} did not finish within {self.spec.timeout_s:.0f}s; "
                                  "the transfer group is now unusable") from None
        finally:
            pool.shutdown(wait=False)

    def read(self, manifest: Manifest, deadline: float) -> Iterator[tuple[Bucket, torch.Tensor]]:
        return iter(())  # pushed into the engines during the put

    def free(self, manifest: Manifest) -> None:
        pass
