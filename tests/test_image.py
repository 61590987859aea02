"""cluster/Dockerfile: the image installs ray_forge as the user its pods run as."""

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def dockerfile_steps(text: str) -> list[tuple[str, str, str]]:
    """(instruction, arguments, the user it runs as) of each Dockerfile line, comments dropped."""
    steps, user = [], "root"  # a FROM image's default; Ray's sets its own, stated again below
    for line in text.replace("\\\n", " ").splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        instruction, _, args = line.partition(" ")
        instruction = instruction.upper()
        if instruction == "USER":
            user = args.strip()
        steps.append((instruction, args.strip(), user))
    return steps


def test_the_image_installs_as_its_user_into_a_folder_it_owns():
    """An editable install writes into /app: as root it leaves root-owned files the pods'
    user (uid 1000, `ray`) cannot update, and into a root-owned /app as `ray` it fails."""
    steps = dockerfile_steps((ROOT / "cluster/Dockerfile").read_text())
    installs = [(args, user) for op, args, user in steps if op == "RUN" and "pip install" in args]
    assert installs and all(user == "ray" for _, user in installs), installs
    copies = [(args, user) for op, args, user in steps if op == "COPY"]
    assert copies and all(args.startswith("--chown=ray:") for args, _ in copies), copies
    workdir = [args for op, args, _ in steps if op == "WORKDIR"]
    assert workdir == ["/app"]
    made = [args for op, args, user in steps if op == "RUN" and "/app" in args and "pip" not in args]
    assert made and "chown ray:" in made[0], made
    assert steps[-1][2] == "ray"  # the image ends as the user the pods run as
    manifests = [(ROOT / "cluster" / name).read_text() for name in ("raycluster.yaml", "rayjob-blackjack.yaml")]
    assert all("runAsUser: 1000" in text for text in manifests)
