"""Weight sync: a 1 GB fp32 state dict (~100 tensors) from a trainer actor into 2 receiver actors.

Everything is measured in one run, on a 2-node Ray cluster started on this machine (head on
127.0.0.2, where the trainer lives; worker on 127.0.0.3):

- ``memcpy``: an in-process ``copy_`` of the same bytes into preallocated tensors (the limit);
- ``naive``: ``ray.put`` of the torch state dict, ``ray.get`` + ``copy_`` in each receiver;
- ``shm``: the weight store over shared memory (receivers on the trainer's node);
- ``object_store``: the weight store over numpy buckets in Ray's object store;
- ``nixl``: the weight store over Ray Direct Transport and NIXL (each receiver reads the
  trainer's registered buckets into registered buffers of its own, then copies them into its
  tensors), with UCX's choice of transports (the two nodes share this machine's kernel, so UCX
  may take cross-memory attach across them), and again across nodes with ``UCX_TLS=tcp``, the
  path two machines without RDMA NICs would take; each reports the UCX transports it read over;
- naive, object_store and nixl again with the receivers on the other node.

Per receiver, bandwidth is model bytes over the seconds from calling ``get`` on a published
version to having it in the receiver's preallocated tensors; ``sync`` is bytes over the whole
round (the trainer's put plus both receivers). Peak RSS is each receiver's high-water mark
during the get (reset just before it), next to its RSS before the model was allocated.

    python bench/weight_sync.py [--gb 1.0] [--tensors 100] [--reps 3] [--bucket-mb 128]

``--sharded`` measures the trainer's side instead: a 2-rank FSDP2 TorchTitan trainer (gloo) of a
Qwen3 made locally (``--hidden``, ``--layers``, ...), publishing over shared memory, once the old
way (every rank gathers the whole model with ``full_hf_state_dict``, rank 0 puts it) and once
sharded (each rank puts its own rows). Per rank: the peak RSS during a publish over the RSS
before it, and the bytes it moved (received by all-gathers + written to the store); a receiver
reads each version into preallocated tensors, and both must be the same bytes.

    python bench/weight_sync.py --sharded [--hidden 1024] [--layers 8] [--reps 3] [--bucket-mb 128]

The last line printed is a JSON object.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import socket
import statistics
import time
import uuid
from pathlib import Path

import ray
import torch

from ray_forge.cluster.local import LocalCluster, NodeSpec
from ray_forge.weights import StoreSpec, WeightStore

GB = 10**9
HEAD, OTHER = "127.0.0.2", "127.0.0.3"


def shapes(total_bytes: int, num_tensors: int) -> dict[str, tuple[int, int]]:
    cols = 1024
    rows = total_bytes // (4 * cols * num_tensors)
    return {f"layers.{i}.weight": (rows, cols) for i in range(num_tensors)}


def rss_kb(field: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def digest(tensors, dtype: torch.dtype | None = None) -> str:
    """Hash of the bytes (after a round trip through ``dtype``, when the wire converts)."""
    h = hashlib.blake2b(digest_size=16)
    for t in tensors:
        h.update((t.to(dtype).float() if dtype else t).numpy().tobytes())
    return h.hexdigest()


def reset_peak_rss() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS


def trim_heap() -> None:
    """Give freed heap back to the OS, so that a later RSS rise is what a step allocates, not
    memory the allocator happened to keep from earlier work (model loading, a previous step)."""
    import ctypes

    ctypes.CDLL("libc.so.6").malloc_trim(0)


def store_for(actor, spec: StoreSpec) -> WeightStore:
    """One client per store and process, as the trainer and the engines keep theirs (a transport's
    buffers are allocated, and registered, once)."""
    stores = actor.__dict__.setdefault("stores", {})
    return stores.setdefault(spec, WeightStore(spec))


@ray.remote(num_cpus=0)
class Trainer:
    def __init__(self, layout: dict) -> None:
        gen = torch.Generator().manual_seed(0)
        self.state = {k: torch.randn(shape, generator=gen) for k, shape in layout.items()}

    def put_store(self, spec: StoreSpec, version: int) -> float:
        start = time.monotonic()
        store_for(self, spec).put_state_dict(version, self.state)
        return time.monotonic() - start

    def digest(self, dtype: str = "") -> str:
        return digest(self.state.values(), getattr(torch, dtype) if dtype else None)

    def close(self, spec: StoreSpec) -> None:
        """Release what this process holds for the store (a NIXL sender's registered arenas)."""
        if spec in self.__dict__.get("stores", {}):
            self.stores.pop(spec).close()

    def tcp_send(self, host: str, port: int) -> None:
        with socket.create_connection((host, port), timeout=600) as sock:
            for tensor in self.state.values():
                sock.sendall(memoryview(tensor.numpy()).cast("B"))

    def put_naive(self) -> tuple[list, float]:
        start = time.monotonic()
        ref = ray.put(self.state)
        return [ref], time.monotonic() - start  # in a list, so the caller gets the ref, not the dict


@ray.remote(num_cpus=0)
class Receiver:
    def __init__(self, layout: dict) -> None:
        self.base_rss_kb = rss_kb("VmRSS")
        self.into = {k: torch.empty(shape).fill_(1.0) for k, shape in layout.items()}  # pages touched

    def memcpy(self) -> float:
        src = {k: torch.empty_like(v).fill_(2.0) for k, v in self.into.items()}
        start = time.monotonic()
        for k, v in self.into.items():
            v.copy_(src[k])
        return time.monotonic() - start

    def _measured(self, fn) -> dict:
        reset_peak_rss()
        before = rss_kb("VmRSS")
        start = time.monotonic()
        fn()
        seconds = time.monotonic() - start
        return {"seconds": seconds, "peak_rss_mb": rss_kb("VmHWM") / 1024, "rss_before_mb": before / 1024,
                "shmem_after_mb": rss_kb("RssShmem") / 1024, "base_rss_mb": self.base_rss_kb / 1024,
                "threads": torch.get_num_threads()}

    def get_store(self, spec: StoreSpec, version: int) -> dict:
        return self._measured(lambda: store_for(self, spec).get_state_dict(version, into=self.into))

    def ucx_transports(self) -> list[str]:
        """What UCX read remote memory over in this process (NIXL only)."""
        from ray_forge.weights.nixl import ucx_transports

        return ucx_transports()

    def tcp_listen(self) -> tuple[str, int]:
        self.server = socket.create_server((ray.util.get_node_ip_address(), 0))
        return self.server.getsockname()[:2]

    def tcp_recv(self) -> float:
        """One plain TCP stream into the preallocated tensors: the ceiling for any network transport."""
        conn, _ = self.server.accept()
        start = time.monotonic()
        with conn:
            for tensor in self.into.values():
                view, got = memoryview(tensor.numpy()).cast("B"), 0
                while got < len(view):
                    got += conn.recv_into(view[got:])
        return time.monotonic() - start

    def get_naive(self, refs: list) -> dict:
        def fetch():
            state = ray.get(refs[0], timeout=600)
            for k, v in self.into.items():
                v.copy_(state[k])
        return self._measured(fetch)

    def checksum(self) -> float:
        return float(sum(v[:4].sum() for v in self.into.values()))

    def digest(self) -> str:
        return digest(self.into.values())


def place(actor_cls, node_ip: str, *args, env: dict | None = None):
    options = {"runtime_env": {"env_vars": env}} if env else {}
    return actor_cls.options(resources={f"node:{node_ip}": 0.01}, **options).remote(*args)


def run_rounds(name: str, trainer, receivers, put, get, nbytes: int, reps: int, dtype: str = "",
               ucx: bool = False, warmup: int = 1) -> dict:
    """``warmup`` rounds (a store's buffers are allocated, and NIXL's registered, in its first
    rounds: a run pays that once), then ``reps`` measured rounds; medians. Checks every receiver
    ended with exactly the trainer's bytes (``ucx``: asks what UCX read over), then stops the
    receivers. ``first_put_s`` is the first round's put."""
    rounds, first_put_s = [], None
    for rep in range(reps + warmup):
        start = time.monotonic()
        put_result = ray.get(put(rep), timeout=600)
        put_s = put_result if isinstance(put_result, float) else put_result[1]
        first_put_s = put_s if first_put_s is None else first_put_s
        got = ray.get([get(r, rep, put_result) for r in receivers], timeout=600)
        total = time.monotonic() - start
        if rep >= warmup:
            rounds.append((put_s, got, total))
    want = ray.get(trainer.digest.remote(dtype), timeout=600)
    exact = all(d == want for d in ray.get([r.digest.remote() for r in receivers], timeout=600))
    transports = sorted({t for r in receivers for t in ray.get(r.ucx_transports.remote(), timeout=60)}) if ucx else None
    for actor in receivers:
        ray.kill(actor)
    per_receiver = [statistics.median(nbytes / g[i]["seconds"] for _, g, _ in rounds) / GB
                    for i in range(len(receivers))]
    result = {
        "exact": exact,
        "receiver_gbps": [round(x, 3) for x in per_receiver],
        "receiver_gbps_min": round(min(per_receiver), 3),
        # Both receivers read at once: the bytes all of them got per second of the slowest.
        "aggregate_gbps": round(statistics.median(len(receivers) * nbytes / max(x["seconds"] for x in g)
                                                  for _, g, _ in rounds) / GB, 3),
        "put_s": round(statistics.median(p for p, _, _ in rounds), 3), "first_put_s": round(first_put_s, 3),
        "sync_gbps": round(statistics.median(nbytes / t for _, _, t in rounds) / GB, 3),
        "peak_rss_mb": [round(max(g[i]["peak_rss_mb"] for _, g, _ in rounds)) for i in range(len(receivers))],
        # The transfer's own memory: the high-water mark over the RSS just before the get.
        "extra_rss_mb": [round(max(g[i]["peak_rss_mb"] - g[i]["rss_before_mb"] for _, g, _ in rounds))
                         for i in range(len(receivers))],
        "shmem_after_mb": [round(rounds[-1][1][i]["shmem_after_mb"]) for i in range(len(receivers))],
        "base_rss_mb": [round(rounds[0][1][i]["base_rss_mb"]) for i in range(len(receivers))],
    }
    if transports is not None:
        result["ucx_transports"] = transports
    print(f"{name:>28}: {json.dumps(result)}", flush=True)
    return result


def store_rounds(name, trainer, receivers, transport, nbytes, reps, bucket_bytes, dtype=""):
    store = WeightStore.create(StoreSpec(name=f"bench-{uuid.uuid4().hex[:8]}", transport=transport,
                                         keep_versions=1, bucket_bytes=bucket_bytes, dtype=dtype, timeout_s=600))
    nixl = transport == "nixl"
    try:
        return run_rounds(name, trainer, receivers,
                          put=lambda v: trainer.put_store.remote(store.spec, v),
                          get=lambda r, v, _: r.get_store.remote(store.spec, v), nbytes=nbytes, reps=reps,
                          dtype=dtype, ucx=nixl, warmup=store.spec.keep_versions + 1 if nixl else 1)
    finally:
        ray.get(trainer.close.remote(store.spec), timeout=600)
        store.destroy()


def naive_rounds(name, trainer, receivers, nbytes, reps):
    return run_rounds(name, trainer, receivers, put=lambda v: trainer.put_naive.remote(),
                      get=lambda r, v, put_result: r.get_naive.remote(put_result[0]), nbytes=nbytes, reps=reps)


def main() -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sharded", action="store_true", help="the trainer's publish: gathered vs sharded")
    parser.add_argument("--hidden", type=int, default=1024, help="--sharded: the model's hidden size")
    parser.add_argument("--layers", type=int, default=8, help="--sharded: the model's layers")
    parser.add_argument("--gb", type=float, default=1.0)
    parser.add_argument("--tensors", type=int, default=100)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--bucket-mb", type=int, default=128)
    parser.add_argument("--ray-env", nargs="*", default=[], metavar="KEY=VALUE",
                        help="environment for the Ray nodes, e.g. RAY_object_manager_default_chunk_size=...")
    parser.add_argument("--only", nargs="*", default=[], help="run only these cases (no summary ratios)")
    args = parser.parse_args()
    if args.sharded:
        return sharded_main(args)
    layout = shapes(int(args.gb * GB), args.tensors)
    nbytes = sum(r * c * 4 for r, c in layout.values())
    bucket_bytes = args.bucket_mb * 2**20
    node = dict(num_cpus=2, memory_bytes=8 * GB, object_store_bytes=3 * GB)
    ray_env = dict(item.split("=", 1) for item in args.ray_env)
    with LocalCluster([NodeSpec(HEAD, **node), NodeSpec(OTHER, **node)], env=ray_env) as cluster:
        cluster.connect(log_to_driver=False,
                        runtime_env={"env_vars": {"PYTHONPATH": str(Path(__file__).resolve().parent.parent)}})
        trainer = place(Trainer, HEAD, layout)

        def fresh(node_ip: str, env: dict | None = None) -> list:
            """New receiver processes for every case, so no case inherits another's memory."""
            actors = [place(Receiver, node_ip, layout, env=env) for _ in range(2)]
            ray.get([a.checksum.remote() for a in actors], timeout=600)
            return actors

        def nixl_over_tcp() -> dict:
            """Sender and receivers limited to UCX's tcp transport: what two machines without
            RDMA NICs would use (the receivers ask for the bytes; the sender serves them)."""
            tcp_trainer = place(Trainer, HEAD, layout, env={"UCX_TLS": "tcp"})
            try:
                return store_rounds("nixl, across nodes, UCX tcp", tcp_trainer, fresh(OTHER, {"UCX_TLS": "tcp"}),
                                    "nixl", nbytes, args.reps, bucket_bytes)
            finally:
                ray.kill(tcp_trainer)

        probe = fresh(HEAD)[0]

        def best_memcpy() -> float:
            # The limit: the best of several copies in a receiver-like process (same thread count).
            return max(nbytes / ray.get(probe.memcpy.remote(), timeout=600) / GB for _ in range(args.reps + 2))

        memcpy = best_memcpy()
        print(f"{'memcpy':>28}: {memcpy:.3f} GB/s", flush=True)
        tcp = fresh(OTHER)[0]
        tcp_s = []
        for _ in range(args.reps):
            host, port = ray.get(tcp.tcp_listen.remote(), timeout=60)
            pending = tcp.tcp_recv.remote()
            ray.get(trainer.tcp_send.remote(host, port), timeout=600)
            tcp_s.append(ray.get(pending, timeout=600))
        tcp_ceiling = nbytes / statistics.median(tcp_s) / GB
        ray.kill(tcp)
        print(f"{'one TCP stream, across nodes':>28}: {tcp_ceiling:.3f} GB/s", flush=True)
        cases = {
            "naive_same_node": lambda: naive_rounds("naive, same node", trainer, fresh(HEAD), nbytes, args.reps),
            "shm": lambda: store_rounds("shm", trainer, fresh(HEAD), "shm", nbytes, args.reps, bucket_bytes),
            "shm_to_bf16": lambda: store_rounds("shm, fp32->bf16", trainer, fresh(HEAD), "shm", nbytes, args.reps,
                                                bucket_bytes, dtype="bfloat16"),
            "object_store_same_node": lambda: store_rounds("object_store, same node", trainer, fresh(HEAD),
                                                           "object_store", nbytes, args.reps, bucket_bytes),
            "naive_cross_node": lambda: naive_rounds("naive, across nodes", trainer, fresh(OTHER), nbytes, args.reps),
            "object_store_cross_node": lambda: store_rounds("object_store, across nodes", trainer, fresh(OTHER),
                                                            "object_store", nbytes, args.reps, bucket_bytes),
            "nixl_same_node": lambda: store_rounds("nixl, same node", trainer, fresh(HEAD), "nixl", nbytes,
                                                   args.reps, bucket_bytes),
            "nixl_cross_node": lambda: store_rounds("nixl, across nodes", trainer, fresh(OTHER), "nixl", nbytes,
                                                    args.reps, bucket_bytes),
            "nixl_cross_node_tcp": nixl_over_tcp,
        }
        results = {name: case() for name, case in cases.items() if not args.only or name in args.only}
        memcpy = max(memcpy, best_memcpy())  # again at the end: the machine is shared and noisy
        ray.kill(probe)
        ray.shutdown()
    if args.only:
        print(json.dumps({"bench": "weight_sync", "all_exact": all(r["exact"] for r in results.values()),
                          "memcpy_gbps": round(memcpy, 3),
                          "tcp_stream_cross_node_gbps": round(tcp_ceiling, 3), **results}))
        return results
    return summarize(results, memcpy, tcp_ceiling, nbytes, bucket_bytes, args)


def summarize(results: dict, memcpy: float, tcp_ceiling: float, nbytes: int, bucket_bytes: int, args) -> dict:
    def ratio(a: float, b: float) -> float:
        return round(a / b, 3)

    shm, naive_near = results["shm"], results["naive_same_node"]
    cross, naive_far = results["object_store_cross_node"], results["naive_cross_node"]
    rss_bound_mb = 1.2 * (nbytes + bucket_bytes) / 2**20
    summary = {
        "bench": "weight_sync", "model_bytes": nbytes, "tensors": args.tensors, "bucket_mb": args.bucket_mb,
        "receivers": 2, "reps": args.reps, "memcpy_gbps": round(memcpy, 3),
        # One plain socket between the two nodes, one receiver: what the loopback network allows.
        "tcp_stream_cross_node_gbps": round(tcp_ceiling, 3),
        "tcp_stream_vs_naive_cross_node": ratio(tcp_ceiling, results["naive_cross_node"]["receiver_gbps_min"]),
        **{name: r for name, r in results.items()},
        "vs_memcpy": {name: ratio(r["receiver_gbps_min"], memcpy) for name, r in results.items()},
        "vs_naive": {"shm": ratio(shm["receiver_gbps_min"], naive_near["receiver_gbps_min"]),
                     "object_store_same_node": ratio(results["object_store_same_node"]["receiver_gbps_min"],
                                                     naive_near["receiver_gbps_min"]),
                     "object_store_cross_node": ratio(cross["receiver_gbps_min"], naive_far["receiver_gbps_min"])},
        "sync_vs_naive_cross_node": ratio(cross["sync_gbps"], naive_far["sync_gbps"]),
        # What the two receivers together took across nodes, against one plain TCP stream.
        "vs_tcp_stream": {name: ratio(results[name]["aggregate_gbps"], tcp_ceiling)
                          for name in ("object_store_cross_node", "nixl_cross_node", "nixl_cross_node_tcp")},
        # A receiver holds the model; the sync may add one bucket, with 20% slack on the sum.
        "rss_bound_mb": round(rss_bound_mb),
        "model_plus_extra_mb": {name: round(nbytes / 2**20 + max(r["extra_rss_mb"])) for name, r in results.items()},
    }
    summary["targets"] = {
        "all_exact": all(r["exact"] for r in results.values()),
        "shm_ge_half_memcpy": summary["vs_memcpy"]["shm"] >= 0.5,
        "cross_node_ge_5x_naive": summary["vs_naive"]["object_store_cross_node"] >= 5,
        "store_rss_within_bound": all(summary["model_plus_extra_mb"][k] <= rss_bound_mb
                                      for k in ("shm", "shm_to_bf16", "object_store_same_node",
                                                "object_store_cross_node")),
        "nixl_same_node_ge_0.8_memcpy": summary["vs_memcpy"]["nixl_same_node"] >= 0.8,
        "nixl_cross_node_ge_0.8_tcp_stream": summary["vs_tcp_stream"]["nixl_cross_node"] >= 0.8,
        "nixl_over_tcp_ge_0.8_tcp_stream": summary["vs_tcp_stream"]["nixl_cross_node_tcp"] >= 0.8,
        # A NIXL receiver keeps a registered copy of the version beside its tensors (an engine
        # loads from it after the transfer): two models and a bucket, 20% slack.
        "nixl_rss_within_bound": all(summary["model_plus_extra_mb"][k] <= 1.2 * (2 * nbytes + bucket_bytes) / 2**20
                                     for k in ("nixl_same_node", "nixl_cross_node", "nixl_cross_node_tcp")),
    }
    print(json.dumps(summary))
    return summary


# -- --sharded: the trainer's publish, gathered (before) and sharded (after) -------------------------
def _trainer_class():
    from ray_forge.actors.trainer import TitanTrainer
    from ray_forge.models.decoder import full_hf_state_dict
    from ray_forge.weights.shards import local_hf_pieces

    class BenchTrainer(TitanTrainer):
        """A TorchTitan rank that can also publish the old way, to measure both."""

        def measure_publish(self, spec: StoreSpec, version: int, gathered: bool) -> dict:
            store = self.store = self.store if self.store and self.store.spec == spec else WeightStore(spec)
            trim_heap()
            reset_peak_rss()
            before = rss_kb("VmRSS")
            start = time.monotonic()
            if gathered:  # the path before sharded sync: every rank gathers, rank 0 puts
                state = full_hf_state_dict(self.model, self.adapter)
                written = store.put_state_dict(version, state).nbytes if self.rank == 0 else 0
                del state
            else:
                written = store.put_shards(version, local_hf_pieces(self.model, self.adapter), rank=self.rank,
                                           num_ranks=self.world_size).nbytes
            seconds = time.monotonic() - start
            return {"seconds": seconds, "peak_rss_mb": rss_kb("VmHWM") / 1024,
                    "extra_rss_mb": (rss_kb("VmHWM") - before) / 1024,
                    "gathered_mb": (self._gathered_bytes() if gathered else 0) / 2**20, "written_mb": written / 2**20}

        def _gathered_bytes(self) -> int:
            """What full_hf_state_dict's all-gathers bring to this rank: the others' rows of every
            state-dict tensor (a tied one twice: the state dict lists it under both names; the fused
            wqkv once, in its state-dict hook)."""
            from torch.distributed.tensor import DTensor

            return sum((p.numel() - p.to_local().numel()) * p.element_size()
                       for _, p in self.model.named_parameters(remove_duplicate=False) if isinstance(p, DTensor))

        def shard_mb(self) -> float:
            return sum(p.to_local().numel() * p.element_size() for p in self.model.parameters()) / 2**20

    return ray.remote(BenchTrainer)


@ray.remote(num_cpus=0)
class StoreReader:
    """A receiver: the version into preallocated tensors, its extra RSS, and a digest of the bytes."""

    def __init__(self, shapes_dtypes: dict) -> None:
        self.into = {k: torch.zeros(shape, dtype=getattr(torch, dtype)) for k, (shape, dtype) in shapes_dtypes.items()}

    def read(self, spec: StoreSpec, version: int) -> dict:
        trim_heap()
        reset_peak_rss()
        before = rss_kb("VmRSS")
        start = time.monotonic()
        WeightStore(spec).get_state_dict(version, into=self.into)
        return {"seconds": time.monotonic() - start, "extra_rss_mb": (rss_kb("VmHWM") - before) / 1024,
                "digest": digest(self.into[k] for k in sorted(self.into))}


def sharded_main(args) -> dict:
    import tempfile

    from safetensors import safe_open

    from envs.blackjack import BlackjackTextEnv
    from ray_forge.actors.trainer_group import TrainerGroup
    from ray_forge.config.schema import GRPOConfig, TinyModelConfig, TrainerConfig
    from ray_forge.models.tiny import make_tiny_qwen3

    heads = args.hidden // 64
    shape = TinyModelConfig(hidden_size=args.hidden, intermediate_size=int(2.75 * args.hidden) // 64 * 64,
                            num_layers=args.layers, num_heads=heads, num_kv_heads=max(1, heads // 2), head_dim=64)
    folder = Path(tempfile.mkdtemp(prefix="bench-sharded-"))
    model_dir = make_tiny_qwen3(folder / "model", BlackjackTextEnv.corpus(), shape)
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        layout = {k: (tuple(f.get_slice(k).get_shape()), "float32") for k in f.keys()}
    model_mb = sum(4 * torch.Size(s).numel() for s, _ in layout.values()) / 2**20
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, object_store_memory=512 * 2**20,
             runtime_env={"env_vars": {"PYTHONPATH": str(Path(__file__).resolve().parent.parent)}})
    Trainer = _trainer_class()
    results, digests = {}, {}
    for mode in ("gathered", "sharded"):
        ranks = [Trainer.options(num_cpus=1).remote(
            TrainerConfig(num_ranks=2, dtype="float32"), model_dir=str(model_dir), grpo=GRPOConfig(), total_steps=1,
            rank=r,
                allowed_token_ids=None) for r in range(2)]
        group = TrainerGroup(ranks, timeout_s=600)
        group.setup()
        spec = StoreSpec(name=f"bench-{mode}-{uuid.uuid4().hex[:6]}", transport="shm", keep_versions=1,
                         bucket_bytes=args.bucket_mb * 2**20, timeout_s=600, senders=("trainer-0", "trainer-1"))
        store = WeightStore.create(spec)
        reader = StoreReader.remote(layout)
        rounds = []
        for version in range(1, args.reps + 1):
            per_rank = ray.get([r.measure_publish.remote(spec, version, mode == "gathered") for r in ranks],
                               timeout=600)
            rounds.append((per_rank, ray.get(reader.read.remote(spec, version), timeout=600)))
        shard_mb = ray.get([r.shard_mb.remote() for r in ranks], timeout=60)
        digests[mode] = {reading["digest"] for _, reading in rounds}
        results[mode] = {
            "rank_shard_mb": [round(x, 1) for x in shard_mb],
            "publish_s": [round(statistics.median(p[i]["seconds"] for p, _ in rounds), 3) for i in range(2)],
            "rank_peak_rss_mb": [round(max(p[i]["peak_rss_mb"] for p, _ in rounds)) for i in range(2)],
            "rank_extra_rss_mb": [round(max(p[i]["extra_rss_mb"] for p, _ in rounds)) for i in range(2)],
            "rank_gathered_mb": [round(rounds[0][0][i]["gathered_mb"], 1) for i in range(2)],
            "rank_written_mb": [round(rounds[0][0][i]["written_mb"], 1) for i in range(2)],
            "receiver_s": round(statistics.median(r["seconds"] for _, r in rounds), 3),
            "receiver_extra_rss_mb": round(max(r["extra_rss_mb"] for _, r in rounds)),
        }
        print(f"{mode:>9}: {json.dumps(results[mode])}", flush=True)
        store.destroy()
        group.shutdown()
        for actor in [*ranks, reader]:
            ray.kill(actor)
    ray.shutdown()
    summary = {"bench": "weight_sync_sharded", "model_mb": round(model_mb, 1), "ranks": 2, "bucket_mb": args.bucket_mb,
               "reps": args.reps, "model": {"hidden": args.hidden, "layers": args.layers, "heads": heads},
               # Both paths deliver the same bytes: the receiver's digest is one and the same.
               "exact": len(digests["gathered"] | digests["sharded"]) == 1, **results}
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
