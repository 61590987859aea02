"""bench/gpu_check.py at its tiny size on a CPU (gloo, 1 rank), run as a subprocess like on the GPU
machine, so the check cannot rot: every section runs, the export matches transformers, the JSON has
its fields. The same run on CUDA is marked gpu and skipped without it."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent

from bench import gpu_check

SECTIONS = gpu_check.SECTIONS


def run_check(*args: str) -> dict:
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--size", "tiny", *args],
                          capture_output=True, text=True, timeout=300)
    result = json.loads(proc.stdout.strip().splitlines()[-1])  # the last line is the JSON, whatever happened
    assert proc.returncode == 0 and result["ok"], proc.stderr[-4000:]
    return result


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])])
def test_tiny_bf16_run_reports_every_section(device):
    result = run_check("--device", device)
    assert [result[s]["status"] for s in SECTIONS] == ["ok"] * 5
    assert result["param_dtype"] == "bfloat16" and result["torchtitan"] and result["transformers"]

    setup = result["setup"]
    assert setup["tied_embeddings"] is True
    shape = result["shape"]  # tied: the embedding counts once
    per_layer = (shape["hidden_size"] * shape["head_dim"] * (2 * shape["num_attention_heads"]
                                                             + 2 * shape["num_key_value_heads"])
                 + 3 * shape["hidden_size"] * shape["intermediate_size"] + 2 * shape["hidden_size"]
                 + 2 * shape["head_dim"])
    assert setup["num_params"] == (shape["vocab_size"] * shape["hidden_size"] + shape["hidden_size"]
                                   + shape["num_hidden_layers"] * per_layer)

    train = result["train"]
    assert len(train["losses"]) == len(train["step_s"]) == train["steps"] == 3
    assert all(math.isfinite(x) for x in train["losses"]) and train["loss_decreased"]
    assert abs(train["losses"][0] - math.log(shape["vocab_size"])) < 0.5  # random init, random tokens
    assert train["tokens_per_s"] == pytest.approx(train["batch"] * train["seq_len"] / train["step_s_median"])
    assert train["peak_flops"] == 989e12 and train["flops_per_token"] == 6 * setup["num_params"]
    assert train["mfu"] == pytest.approx(6 * setup["num_params"] * train["tokens_per_s"] / 989e12)
    assert 0 < train["mfu"] < 1

    export = result["export"]
    assert export["passed"] and export["keys_match"] and export["hf_tied"]
    assert export["titan_vs_fp32_rel_err"] < export["tolerance"]
    assert export["logits_rel_err"] < 0.05 and export["top1_agree"] > 0.9

    store = result["store"]
    assert store["source"] == "torchtitan" and store["num_tensors"] == export["num_tensors"]
    assert store["gb"] == pytest.approx(setup["num_params"] * 2 / 1e9)  # bf16, the tied weight once
    kinds = ("pinned", "pageable") if device == "cuda" else ("pageable",)
    for kind in kinds:
        assert all(store[kind][k] > 0 for k in ("put_gbps", "get_gbps", "d2h_gbps", "h2d_gbps", "put_vs_d2h"))

    nixl = result["nixl"]  # the CPU venv has NIXL (the weights.transport=nixl install): the section runs
    assert nixl["available"] and nixl["gb"] == pytest.approx(store["gb"], rel=0.01)
    assert nixl["num_buckets"] == store["num_buckets"] and nixl["read_gbps"] > 0 and nixl["read_vs_copy"] > 0


def test_tiny_float32_run_uses_project_sharding_and_many_buckets():
    """float32 through the trainer's own build (``models.decoder.build_sharded_decoder``): the export is exact."""
    result = run_check("--device", "cpu", "--param-dtype", "float32", "--bucket-mb", "0.05", "--reps", "1")
    assert result["export"]["logits_rel_err"] < 1e-4 and result["export"]["passed"]
    assert result["store"]["num_buckets"] >= 4
    assert result["store"]["gb"] == pytest.approx(result["setup"]["num_params"] * 4 / 1e9)


def test_a_failing_section_is_reported_and_the_rest_still_run(tmp_path):
    report = {}
    run = gpu_check.Run(args=gpu_check.parse_args(["--size", "tiny", "--device", "cpu"]), work=tmp_path, shape={})

    def broken(_run):
        raise RuntimeError("no accelerator")

    gpu_check.run_section(report, "train", broken, run)
    gpu_check.run_section(report, "export", broken, run, ready=False)
    gpu_check.run_section(report, "store", lambda _run: {"gb": 1.0}, run)
    assert report["train"]["status"] == "failed" and "RuntimeError: no accelerator" in report["train"]["error"]
    assert report["export"] == {"status": "skipped", "error": "setup failed"}
    assert report["store"]["status"] == "ok" and report["store"]["gb"] == 1.0


def test_shim_lets_torchtitan_import_without_data_parallel_mesh_dims(monkeypatch):
    """torch 2.11 has no ``torch.distributed.fsdp.DataParallelMeshDims``; TorchTitan 0.3.0 imports it."""
    import torch.distributed.fsdp as fsdp

    if hasattr(fsdp, "DataParallelMeshDims"):
        monkeypatch.delattr(fsdp, "DataParallelMeshDims")
    assert gpu_check.shim_torch_for_torchtitan() == ["torch.distributed.fsdp.DataParallelMeshDims"]
    from torch.distributed.fsdp import DataParallelMeshDims  # noqa: F401  - what torchtitan's fsdp.py does

    assert gpu_check.shim_torch_for_torchtitan() == []
