"""Checkpoint files: atomic commit, checksums, pruning, and a full disk (no Ray, no model)."""

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ray_forge.core import checkpoint
from ray_forge.core.checkpoint import CheckpointError

ROOT = Path(__file__).resolve().parent.parent


def write(run_dir: Path, step: int, payload: bytes = b"weights", keep: int = 2) -> Path:
    staging = checkpoint.staging_dir(run_dir, step)
    (staging / checkpoint.TRAINER_DIR / "__0_0.distcp").write_bytes(payload)
    return checkpoint.commit(run_dir, step, staging, {"step": step}, keep)


def test_commit_verifies_and_keeps_the_newest(tmp_path):
    for step in (2, 4, 6):
        write(tmp_path, step)
    assert [p.name for p in sorted((tmp_path / "checkpoints").iterdir())] == ["step-00000004", "step-00000006"]
    newest = checkpoint.latest(tmp_path)
    assert checkpoint.step_of(newest) == 6 and checkpoint.problem(newest) is None
    assert checkpoint.read_driver_state(newest) == {"step": 6}


@pytest.mark.parametrize("damage, reason", [
    (lambda p: (p / "trainer/__0_0.distcp").write_bytes(b"weigh"), "is 5 bytes, the manifest says 7"),
    (lambda p: (p / "trainer/__0_0.distcp").write_bytes(b"WEIGHT!"), "does not match its checksum"),
    (lambda p: (p / "driver.pkl").unlink(), "driver.pkl is missing"),
    (lambda p: (p / "manifest.json").unlink(), "no manifest (the write did not finish)"),
])
def test_a_damaged_newest_checkpoint_is_skipped_with_its_reason(tmp_path, caplog, damage, reason):
    write(tmp_path, 2)
    damage(write(tmp_path, 4))
    assert checkpoint.latest(tmp_path).name == "step-00000002"
    assert "checkpoint step-00000004 skipped: " in caplog.text and reason in caplog.text


def test_a_leftover_partial_write_is_ignored_and_replaced(tmp_path):
    write(tmp_path, 2)
    partial = checkpoint.staging_dir(tmp_path, 4)  # a crash mid-write leaves this behind
    (partial / "trainer" / "junk").write_bytes(b"x")
    assert checkpoint.latest(tmp_path).name == "step-00000002"
    write(tmp_path, 4)
    assert not partial.exists() and checkpoint.latest(tmp_path).name == "step-00000004"


FULL_DISK = textwrap.dedent("""
    import sys
    from pathlib import Path
    from ray_forge.core import checkpoint
    run_dir = Path(sys.argv[1])
    staging = checkpoint.staging_dir(run_dir, 2)
    (staging / "trainer" / "__0_0.distcp").write_bytes(b"w" * 100_000)
    checkpoint.commit(run_dir, 2, staging, {"step": 2}, keep=2)
    staging = checkpoint.staging_dir(run_dir, 4)
    try:
        (staging / "trainer" / "__0_0.distcp").write_bytes(b"w" * 100_000)
        checkpoint.commit(run_dir, 4, staging, {"step": 4, "big": b"b" * 4_000_000}, keep=2)
    except checkpoint.CheckpointError as err:
        print("ERROR", err)
    print("LATEST", checkpoint.latest(run_dir).name, checkpoint.problem(checkpoint.latest(run_dir)))
    print("LEFT", sorted(p.name for p in (run_dir / "checkpoints").iterdir()))
""")


def test_a_full_disk_keeps_the_previous_checkpoint_and_says_so(tmp_path):
    """A real full disk: a 1 MiB tmpfs mounted in a user and mount namespace of its own."""
    if shutil.which("unshare") is None:
        pytest.skip("needs util-linux's unshare to mount a small tmpfs")
    disk = tmp_path / "disk"
    disk.mkdir()
    script = f"mount -t tmpfs -o size=1m tmpfs {disk} && exec {sys.executable} -c '{FULL_DISK}' {disk}/run"
    proc = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", script],
                          capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert ("ERROR checkpoint of step 4 could not be written in" in proc.stdout
            and "No space left on device" in proc.stdout and "the previous checkpoint step-00000002 is intact"
            in proc.stdout), proc.stdout
    assert "LATEST step-00000002 None" in proc.stdout
    assert "LEFT ['step-00000002']" in proc.stdout  # nothing half-written stays behind


def test_a_failed_write_names_the_previous_checkpoint(tmp_path):
    write(tmp_path, 2)
    staging = checkpoint.staging_dir(tmp_path, 4)
    err = checkpoint.failed(tmp_path, 4, staging, OSError(28, "No space left on device"))
    assert isinstance(err, CheckpointError) and not staging.exists()
    assert "No space left on device" in str(err) and "step-00000002 is intact" in str(err)


def test_a_checkpoint_missing_a_ranks_files_is_refused(tmp_path):
    """A rank that wrote its shards elsewhere (no shared storage) must not leave a checkpoint that verifies."""
    write(tmp_path, 2)
    staging = checkpoint.staging_dir(tmp_path, 4)
    (staging / checkpoint.DCP_METADATA).write_bytes(b"m")
    with pytest.raises(CheckpointError, match=r"trainer/rank-1\.pt not written .*step-00000002 is intact"):
        checkpoint.commit(tmp_path, 4, staging, {"step": 4}, keep=2,
                          expected=[checkpoint.DCP_METADATA, checkpoint.rank_file(0), checkpoint.rank_file(1)])
    assert checkpoint.latest(tmp_path).name == "step-00000002" and not staging.exists()


class _Counter:
    """A part of the driver's state, as the manager sees one."""

    def __init__(self) -> None:
        self.value = 0

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = state["value"]


class _Shards:
    """A component that writes its own file into the checkpoint (as the trainer ranks do)."""

    def __init__(self) -> None:
        self.loaded = []

    def files(self) -> list[str]:
        return [f"{checkpoint.TRAINER_DIR}/shard"]

    async def save(self, folder: Path) -> dict:
        (folder / checkpoint.TRAINER_DIR / "shard").write_text("w")
        return {"written": True}

    async def load(self, folder: Path, saved: dict, step: int) -> None:
        self.loaded.append(((folder / checkpoint.TRAINER_DIR / "shard").read_text(), saved, step))


def test_the_manager_owns_the_cadence_and_gathers_every_part(tmp_path):
    """Every 3 steps and at the last; each part's state_dict in the driver state, each writer's files
    in the checkpoint; restore brings the states back, attach the writers."""
    import asyncio

    from ray_forge.core.cadence import every

    assert [s for s in range(1, 8) if every(3, s, 7)] == [3, 6, 7]
    assert [s for s in range(1, 8) if every(0, s, 7)] == [7] and not any(every(0, s) for s in range(1, 8))
    manager, counter = checkpoint.CheckpointManager(tmp_path, every_n=3, keep=5), _Counter()
    manager.add(counter=counter, shards=_Shards())

    async def run() -> list:
        saved = []
        for step in range(1, 8):
            counter.value = step * 10
            saved.append(await manager.save(step, last_step=step == 7) is not None)
        return saved

    assert asyncio.run(run()) == [False, False, True, False, False, True, True]
    newest = checkpoint.latest(tmp_path)
    assert checkpoint.read_driver_state(newest) == {"step": 7, "shards": {"written": True}, "value": 70}
    resumed = checkpoint.CheckpointManager(tmp_path, every_n=3, keep=5, resume_from=newest)
    again, shards = _Counter(), _Shards()
    resumed.add(counter=again)
    saved = resumed.restore()
    assert again.value == 70
    asyncio.run(resumed.attach(saved, shards=shards))
    assert shards.loaded == [("w", {"written": True}, 7)]
    older = _Shards()  # a writer the checkpoint kept nothing for (written before it had one) gets None
    asyncio.run(resumed.attach(saved, older=older))
    assert older.loaded == [("w", None, 7)]


def test_the_manager_refuses_two_parts_that_claim_one_key(tmp_path):
    import asyncio

    manager = checkpoint.CheckpointManager(tmp_path, every_n=1, keep=1)
    manager.add(one=_Counter(), two=_Counter())
    with pytest.raises(ValueError, match=r"the checkpoint's two state and another part both hold \['value'\]"):
        asyncio.run(manager.save(1))
