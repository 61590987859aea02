"""One-GPU check of ray_forge's trainer side, with no vLLM and no Ray.

A Qwen3-1.7B-shaped model (random init, tied embeddings) is written as a local HF folder, built in
TorchTitan by ``ray_forge.models.decoder``, sharded with FSDP2 on a 1-rank group (nccl on cuda, gloo on
cpu; bf16 compute, float32 masters; built on the meta device as a trainer rank builds it), then each section reports its figures, status and error:
train (tokens/s, MFU = 6 * N * tokens/s over 989e12, the H200's dense bf16 peak), export (to HF,
logits against transformers), store (the whole model put from device memory into host buckets and
got back, with ``ray_forge/weights/layout.py``, in GB/s next to one plain copy of the same bytes),
nixl (the model's buckets read from one registered device arena into another over NIXL, as
``weights.transport=nixl`` moves them, next to a plain device copy; reported as not available
where NIXL does not import, without failing the check).
Progress goes to stderr; the last line on stdout is a JSON object. With bench/gpu_wheels.txt in .whl/:

    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && \
      export PYTHONPATH=/tmp/site:$PWD && python3 bench/gpu_check.py    # 1.7B shape, cuda: ~3 min
    python bench/gpu_check.py --size tiny --device cpu                   # what the tests run
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from importlib.metadata import distributions
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent

log = logging.getLogger("gpu_check")

H200_BF16_DENSE_FLOPS = 989e12
SECTIONS = ("setup", "train", "export", "store", "nixl")
SIZES = {  # HF config.json shape, run defaults
    "1p7b": (dict(hidden_size=2048, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                  intermediate_size=6144, vocab_size=151936, max_position_embeddings=40960),
             dict(batch=4, seq_len=2048, steps=10)),
    "tiny": (dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  intermediate_size=128, vocab_size=512, max_position_embeddings=256),
             dict(batch=2, seq_len=32, steps=3)),
}


@dataclass
class Run:
    """What the sections share: the arguments, the work folder, and what setup built."""

    args: argparse.Namespace
    work: Path
    shape: dict
    model_dir: Path | None = None
    model: torch.nn.Module | None = None
    adapter: object = None

    @property
    def dtype(self) -> torch.dtype:
        return getattr(torch, self.args.param_dtype)

    def sync(self) -> None:
        if self.args.device == "cuda":
            torch.cuda.synchronize()


def shim_torch_for_torchtitan() -> list[str]:
    """TorchTitan 0.3.0's ``distributed/fsdp.py`` (imported by ``torchtitan.models.qwen3``) imports
    ``torch.distributed.fsdp.DataParallelMeshDims``, which torch 2.11 lacks. Only the full_dtensor and
    spmd_types backends build one, never ray_forge's partial_dtensor, so a stand-in lets it import."""
    import torch.distributed.fsdp as fsdp

    if hasattr(fsdp, "DataParallelMeshDims"):
        return []
    fsdp.DataParallelMeshDims = type("DataParallelMeshDims", (), {})  # only ever an annotation here
    return ["torch.distributed.fsdp.DataParallelMeshDims"]


def section_setup(run: Run) -> dict:
    """A random Qwen3 of ``run.shape`` with tied embeddings as an HF folder, then in TorchTitan."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(**run.shape, tie_word_embeddings=True, rope_theta=1e6, rms_norm_eps=1e-6,
                         dtype=run.args.param_dtype)
    torch.manual_seed(0)
    with torch.device(run.args.device):  # random init on the GPU: seconds, not minutes
        Qwen3ForCausalLM(config).to(run.dtype).save_pretrained(run.work / "model")
    run.model_dir = run.work / "model"
    log.info("wrote %s; building TorchTitan Qwen3", run.model_dir)
    shims = shim_torch_for_torchtitan()
    from ray_forge.models.decoder import build_sharded_decoder

    # What a trainer rank does: meta-device build, FSDP2 (bf16 compute, fp32 masters), its rows loaded.
    run.model, run.adapter = build_sharded_decoder(run.model_dir, 1, run.args.device, run.args.param_dtype)
    return {"num_params": sum(p.numel() for p in run.model.parameters()),  # the tied weight once
            "tied_embeddings": run.model.tok_embeddings.weight is run.model.lm_head.weight, "shims": shims}


def section_train(run: Run) -> dict:
    """Random tokens, next-token loss, AdamW; tokens/s of the median step after warm-up."""
    from torchtitan.distributed import utils as dist_utils

    args, model, shape = run.args, run.model, run.shape
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens_BT1 = torch.randint(shape["vocab_size"], (args.batch, args.seq_len + 1),
                               generator=torch.Generator().manual_seed(1)).to(args.device)
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    losses, step_s = [], []
    for step in range(args.steps):
        run.sync()
        start = time.perf_counter()
        logits_BTV = model(tokens_BT1[:, :-1])
        loss = F.cross_entropy(logits_BTV.flatten(0, 1).float(), tokens_BT1[:, 1:].flatten())
        loss.backward()
        grad_norm = dist_utils.clip_grad_norm_(list(model.parameters()), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        run.sync()
        step_s.append(time.perf_counter() - start)
        losses.append(loss.item())
        log.info("step %d: loss %.4f, grad norm %.3f, %.3f s", step, losses[-1], float(grad_norm), step_s[-1])
    del optimizer  # its states would crowd the next sections
    num_warmup = 1 if args.steps <= 3 else 2
    median_s = statistics.median(step_s[num_warmup:] or step_s)
    tokens_per_s = args.batch * args.seq_len / median_s
    num_params = sum(p.numel() for p in model.parameters())
    return {"batch": args.batch, "seq_len": args.seq_len, "steps": args.steps, "warmup_steps": num_warmup,
            "step_s": [round(s, 4) for s in step_s], "step_s_median": median_s, "tokens_per_s": tokens_per_s,
            "flops_per_token": 6 * num_params, "peak_flops": H200_BF16_DENSE_FLOPS,
            "mfu": 6 * num_params * tokens_per_s / H200_BF16_DENSE_FLOPS,  # attention not counted
            "losses": losses, "loss_decreased": losses[-1] < losses[0],
            "peak_memory_gb": torch.cuda.max_memory_allocated() / 1e9 if args.device == "cuda" else None}


def section_export(run: Run) -> dict:
    """Export, then logits on the same tokens. bf16 rounding grows with depth (3% at 28 layers), so
    against transformers in float32, TorchTitan's error must be within 2x (+0.005) of transformers'
    own bf16 error (in float32 that error is 0 and the margin 1e-4)."""
    from safetensors import safe_open
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from ray_forge.models.decoder import full_hf_state_dict

    state = full_hf_state_dict(run.model, run.adapter)  # a collective; CPU tensors in HF naming
    with safe_open(next(run.model_dir.glob("*.safetensors")), "pt") as f:
        keys_match = set(state) == set(f.keys())
    out = run.work / "export"
    out.mkdir()
    save_file({k: v.to(run.dtype).contiguous() for k, v in state.items()}, out / "model.safetensors")
    shutil.copy(run.model_dir / "config.json", out / "config.json")
    num_tensors = len(state)
    del state
    ids_BT = torch.randint(run.shape["vocab_size"], (2, min(128, run.args.seq_len)),
                           generator=torch.Generator().manual_seed(2)).to(run.args.device)
    with torch.no_grad():
        titan_BTV = run.model(ids_BT).float()
        hf_BTV = {}  # by dtype: the run's, and float32 as the reference
        for dtype in (run.dtype, torch.float32):
            hf = AutoModelForCausalLM.from_pretrained(out, dtype=dtype).to(run.args.device).eval()
            hf_tied = hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
            hf_BTV[dtype] = hf(input_ids=ids_BT).logits.float()
            del hf
    ours, reference = hf_BTV[run.dtype], hf_BTV[torch.float32]

    def rel_err(a, b):
        return float((a - b).norm() / b.norm())

    titan_error, hf_error = rel_err(titan_BTV, reference), rel_err(ours, reference)
    tolerance = 2 * hf_error + (1e-4 if run.dtype == torch.float32 else 0.005)
    return {"num_tensors": num_tensors, "keys_match": keys_match, "hf_tied": hf_tied,
            "logits_rel_err": rel_err(titan_BTV, ours),
            "top1_agree": float((titan_BTV.argmax(-1) == ours.argmax(-1)).float().mean()),
            "titan_vs_fp32_rel_err": titan_error, "hf_vs_fp32_rel_err": hf_error, "tolerance": tolerance,
            "passed": bool(titan_error < tolerance and keys_match and hf_tied)}


def load_layout():
    """``ray_forge/weights/layout.py`` alone: the package's ``__init__`` imports Ray."""
    spec = importlib.util.spec_from_file_location("ray_forge_weights_layout", ROOT / "ray_forge/weights/layout.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def section_store(run: Run) -> dict:
    """The model in HF naming on the device (the folder's weights if setup failed) put into host
    buckets as the shm transport writes them and got into device tensors as ``get_state_dict(into=)``
    does, against one plain copy of the same bytes; pinned, and pageable like the shm files."""
    from safetensors.torch import load_file
    from torch.distributed.tensor import DTensor

    layout, device = load_layout(), run.args.device
    run.sync()
    start = time.perf_counter()
    if run.model is not None:  # what the trainer publishes, left on the device
        state = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in run.model.state_dict().items()}
        weights = {k: v.to(run.dtype).contiguous() for k, v in run.adapter.to_hf(state).items()}
    else:
        weights = load_file(next(run.model_dir.glob("*.safetensors")), device=device)
    run.sync()
    buckets = layout.plan_buckets(weights, int(run.args.bucket_mb * 2**20))
    nbytes = sum(v.numel() * v.element_size() for v in weights.values())
    report = {"source": "hf_folder" if run.model is None else "torchtitan", "gather_s": time.perf_counter() - start,
              "gb": nbytes / 1e9, "num_tensors": len(weights), "num_buckets": len(buckets),
              "bucket_mb": run.args.bucket_mb, "reps": run.args.reps}
    into = {k: torch.empty_like(v) for k, v in weights.items()}
    flat_device = torch.empty(nbytes, dtype=torch.uint8, device=device)

    def best_s(fn) -> float:
        times = []
        for _ in range(run.args.reps):
            run.sync()
            begin = time.perf_counter()
            fn()
            run.sync()
            times.append(time.perf_counter() - begin)
        return min(times)

    for kind in ("pinned", "pageable") if device == "cuda" else ("pageable",):
        buffers = [torch.empty(b.nbytes, dtype=torch.uint8, pin_memory=kind == "pinned") for b in buckets]
        flat_host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=kind == "pinned")
        put_s = best_s(lambda: [layout.pack_into(b, weights, buffer) for b, buffer in zip(buckets, buffers)])
        get_s = best_s(lambda: [into[name].copy_(view) for b, buffer in zip(buckets, buffers)
                                for name, view in layout.unpack(b, buffer)])
        d2h_s = best_s(lambda: flat_host.copy_(flat_device))
        h2d_s = best_s(lambda: flat_device.copy_(flat_host))
        if not all(torch.equal(into[k], weights[k]) for k in weights):
            raise AssertionError(f"{kind}: the weights got back differ from those put")
        report[kind] = {"put_gbps": nbytes / put_s / 1e9, "get_gbps": nbytes / get_s / 1e9,
                        "d2h_gbps": nbytes / d2h_s / 1e9, "h2d_gbps": nbytes / h2d_s / 1e9,
                        "put_vs_d2h": d2h_s / put_s, "get_vs_h2d": h2d_s / get_s}
        log.info("store %s: %s", kind, {k: round(v, 2) for k, v in report[kind].items()})
        del buffers, flat_host
    return report


def section_nixl(run: Run) -> dict:
    """The model's buckets read over NIXL, as ``weights.transport=nixl`` moves them, on the device:
    a sender agent registers one arena holding every bucket (as a trainer rank does), a receiver
    agent registers one of its own and reads every bucket into it in one transfer (as an engine
    does), against one plain device copy of the same bytes. NIXL's own API, two agents in this
    process: Ray is too large to carry here, and RDT adds only the exchange of metadata."""
    try:
        from nixl._api import nixl_agent, nixl_agent_config
    except Exception as err:  # the check still reports the other sections
        return {"available": False, "why": f"nixl does not import: {type(err).__name__}: {err}"[:500]}
    layout, device = load_layout(), run.args.device
    weights = load_file_weights(run)
    buckets = layout.plan_buckets(weights, int(run.args.bucket_mb * 2**20))
    nbytes = sum(b.nbytes for b in buckets)
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.zeros(nbytes, dtype=torch.uint8, device=device)
    offsets, at = [], 0
    for bucket in buckets:
        offsets.append(at)
        layout.pack_into(bucket, weights, src[at:at + bucket.nbytes])
        at += bucket.nbytes
    config = nixl_agent_config(backends=["UCX"])
    sender, receiver = nixl_agent("gpu-check-sender", config), nixl_agent("gpu-check-receiver", config)
    sender.register_memory(src)
    receiver.register_memory(dst)
    receiver.add_remote_agent(sender.get_agent_metadata())
    spans = [(off, b.nbytes) for off, b in zip(offsets, buckets)]
    kind = "cuda" if device == "cuda" else "cpu"
    gpu = torch.cuda.current_device() if device == "cuda" else 0
    remote = sender.get_xfer_descs([(src.data_ptr() + off, n, gpu) for off, n in spans], mem_type=kind)
    local = receiver.get_xfer_descs([(dst.data_ptr() + off, n, gpu) for off, n in spans], mem_type=kind)

    def read() -> None:
        handle = receiver.initialize_xfer("READ", local, remote, "gpu-check-sender", b"gpu_check")
        state = receiver.transfer(handle)
        while state not in ("DONE", "ERR"):
            state = receiver.check_xfer_state(handle)
        receiver.release_xfer_handle(handle)
        if state == "ERR":
            raise RuntimeError("the NIXL transfer ended in its error state")

    def best_s(fn) -> float:
        times = []
        for _ in range(run.args.reps + 1):  # the first also connects the two agents
            run.sync()
            begin = time.perf_counter()
            fn()
            run.sync()
            times.append(time.perf_counter() - begin)
        return min(times[1:])

    read_s = best_s(read)
    if not torch.equal(src, dst):
        raise AssertionError("the buckets read over NIXL differ from those written")
    copy_s = best_s(lambda: dst.copy_(src))
    report = {"available": True, "backend": "UCX", "gb": nbytes / 1e9, "num_buckets": len(buckets),
              "read_gbps": nbytes / read_s / 1e9, "copy_gbps": nbytes / copy_s / 1e9, "read_vs_copy": copy_s / read_s,
              "ucx_tls": os.environ.get("UCX_TLS", "UCX's choice")}
    log.info("nixl: %s", {k: round(v, 3) if isinstance(v, float) else v for k, v in report.items()})
    return report


def load_file_weights(run: Run) -> dict[str, torch.Tensor]:
    """The model's HF tensors on the run's device (the folder setup wrote)."""
    from safetensors.torch import load_file

    return {k: v.to(run.dtype) if v.is_floating_point() else v
            for k, v in load_file(next(run.model_dir.glob("*.safetensors")), device=run.args.device).items()}


def run_section(report: dict, name: str, fn, run: Run, ready: bool = True) -> None:
    """Run one section into ``report[name]``; a failure is recorded, never raised."""
    if not ready:
        report[name] = {"status": "skipped", "error": "setup failed"}
        return
    log.info("== %s", name)
    start = time.perf_counter()
    try:
        report[name] = {"status": "ok", "error": None, **fn(run)}
    except Exception as err:  # reported in the JSON; the next section still runs
        log.exception("%s failed", name)
        report[name] = {"status": "failed", "error": f"{type(err).__name__}: {err}"[:2000]}
    report[name]["seconds"] = round(time.perf_counter() - start, 2)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="1p7b", help="model shape")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--param-dtype", choices=("bfloat16", "float32"), default="bfloat16",
                        help="FSDP2 compute dtype (masters stay float32) and that of the HF files")
    parser.add_argument("--batch", type=int, help="sequences per step (default: per size)")
    parser.add_argument("--seq-len", type=int, help="tokens per sequence (default: per size)")
    parser.add_argument("--steps", type=int, help="train steps, warm-up included (default: per size)")
    parser.add_argument("--bucket-mb", type=float, default=128, help="store bucket MiB (StoreSpec's default)")
    parser.add_argument("--reps", type=int, default=3, help="repetitions of each copy; the best counts")
    args = parser.parse_args(argv)
    for key, value in SIZES[args.size][1].items():
        setattr(args, key, value if getattr(args, key) is None else getattr(args, key))
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s: %(message)s")
    if args.device == "cuda":
        torch.cuda.set_device(0)
    with socket.socket() as s:  # a free port for the 1-rank rendezvous
        s.bind(("127.0.0.1", 0))
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(s.getsockname()[1]))
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo", rank=0, world_size=1)
    run = Run(args=args, work=Path(tempfile.mkdtemp(prefix="gpu_check_")), shape=SIZES[args.size][0])
    installed = {d.metadata["Name"].lower(): d.version for d in distributions()}
    report = {"size": args.size, "device": args.device, "param_dtype": args.param_dtype, "shape": run.shape,
              "device_name": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
              "torch": torch.__version__, "torchtitan": installed.get("torchtitan"),
              "transformers": installed.get("transformers")}
    start = time.perf_counter()
    try:
        run_section(report, "setup", section_setup, run)
        run_section(report, "train", section_train, run, ready=run.model is not None)
        run_section(report, "export", section_export, run, ready=run.model is not None)
        run_section(report, "store", section_store, run, ready=run.model_dir is not None)
        run_section(report, "nixl", section_nixl, run, ready=run.model_dir is not None)
    finally:
        report["ok"] = all(report.get(s, {}).get("status") == "ok" for s in SECTIONS) \
            and bool(report.get("export", {}).get("passed"))
        report["total_s"] = round(time.perf_counter() - start, 1)
        dist.destroy_process_group()
        shutil.rmtree(run.work, ignore_errors=True)
        print(json.dumps(report))
    return report


if __name__ == "__main__":
    sys.exit(0 if main()["ok"] else 1)
