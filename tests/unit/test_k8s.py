"""cluster=k8s (launcher/launch/submit/k8s.py): `launcher submit` renders RUN_DIR/job.yaml, which
validates offline against the Kubernetes schemas (kubernetes-validate, strict: an unknown
field fails) and the Kubeflow Trainer's API models; bad values are refused in one line; with
no kubectl here the submit writes the run directory and prints the exact command."""

from __future__ import annotations

import shlex
import shutil
import sys
from pathlib import Path

import pytest
import yaml

from launcher.launch import cli
from launcher.launch.submit import k8s

K8S_VERSION = "1.30"  # a cluster of the last two years; the schemas ship with kubernetes-validate


def args(run_dir: Path, *more: str) -> list[str]:
    return [
        "cluster=k8s",
        "recipe=fsdp",
        "cluster.nnodes=2",
        "cluster.gpus_per_node=8",
        "cluster.k8s.image=ghcr.io/me/train:1",
        "cluster.k8s.volume_claim=shared-runs",
        f"cluster.k8s.mount_path={run_dir.parent}",
        f"hydra.run.dir={run_dir}",
        "cluster.k8s.tolerations=[{key: nvidia.com/gpu, operator: Exists, effect: NoSchedule}]",
        'cluster.k8s.node_selector=["nvidia.com/gpu.product=NVIDIA-H100-80GB-HBM3"]',
        "+cluster.env.NCCL_SOCKET_IFNAME=eth0",
        "+cluster.env.ODD='$(id) $HOME x'",
        *more,
    ]


def rendered(run_dir: Path, capsys, *more: str) -> list[dict]:
    assert cli.main(["submit", "--dry-run", *args(run_dir, *more)]) == 0
    return list(yaml.safe_load_all(capsys.readouterr().out))


def test_the_job_and_its_service_validate_against_the_kubernetes_schemas(tmp_path, capsys):
    kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="the k8s extra (make test installs it)")

    run = tmp_path / "runs" / "a"
    service, job = rendered(run, capsys)
    for obj in (service, job):
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)  # raises on any unknown or mistyped field
    name = k8s.job_name(str(run))
    assert service["metadata"]["name"] == job["metadata"]["name"] == name
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["selector"] == {"launcher/job": name}
    spec, pod = job["spec"], job["spec"]["template"]["spec"]
    assert (spec["completionMode"], spec["completions"], spec["parallelism"], spec["backoffLimit"]) == (
        "Indexed",
        2,
        2,
        6,
    )  # 3 faults x 2 pods
    assert pod["subdomain"] == name and pod["restartPolicy"] == "OnFailure"
    assert pod["terminationGracePeriodSeconds"] == 300
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    assert pod["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    assert {"name": "run", "persistentVolumeClaim": {"claimName": "shared-runs"}} in pod["volumes"]
    (container,) = pod["containers"]
    assert container["resources"] == {"limits": {"nvidia.com/gpu": 8}}
    assert {"name": "run", "mountPath": str(tmp_path / "runs")} in container["volumeMounts"]
    # The node's torchrun: rank from the completion index, rendezvous at pod 0's DNS name.
    bash, flag, script = container["command"]
    words = shlex.split(script.replace("$$", "$"))
    start = words.index("cd")
    assert (bash, flag, words[start : start + 3]) == ("bash", "-c", ["cd", str(run), "&&"])
    assert "--node-rank=$JOB_COMPLETION_INDEX" in words and "--nnodes=2" in words and "--nproc-per-node=8" in words
    # pod 0 hosts the rendezvous store, without waiting for its own DNS name to resolve
    assert script.startswith('IS_HOST=false; [ "$$JOB_COMPLETION_INDEX" = 0 ] && IS_HOST=true; ')
    assert any(w.startswith("--rdzv-conf=join_timeout=") and w.endswith(",is_host=$IS_HOST") for w in words)
    assert f"--rdzv-endpoint={name}-0.{name}:29500" in words
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env["NCCL_SOCKET_IFNAME"] == "eth0" and env["PYTHONPATH"] == str(run / "code")
    # Kubernetes expands $(NAME) in env values and commands; $$ is its escape for one $.
    assert env["ODD"] == "$$(id) $$HOME x"


def test_the_trainjob_validates_against_the_trainers_api_models(tmp_path, capsys):
    pytest.importorskip("kubeflow_trainer_api", reason="the k8s extra (make test installs it)")
    from kubeflow_trainer_api.models.trainer_v1alpha1_train_job import TrainerV1alpha1TrainJob

    run = tmp_path / "runs" / "b"
    (job,) = rendered(run, capsys, "cluster.k8s.kind=trainjob", "cluster.k8s.service_account=trainer")
    model = TrainerV1alpha1TrainJob.from_dict(job)  # strict types: raises on a wrong one
    assert model.to_dict() == job, "a field the Trainer's API does not know was dropped"
    trainer = job["spec"]["trainer"]
    assert (trainer["numNodes"], trainer["numProcPerNode"], trainer["image"]) == (2, 8, "ghcr.io/me/train:1")
    assert job["spec"]["runtimeRef"] == {"name": "torch-distributed"}
    words = shlex.split(trainer["command"][2].replace("$$", "$"))
    assert "--node-rank=$PET_NODE_RANK" in words and "--rdzv-endpoint=$PET_MASTER_ADDR:$PET_MASTER_PORT" in words
    (patch,) = job["spec"]["runtimePatches"]
    pod = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "trainer" and pod["terminationGracePeriodSeconds"] == 300
    assert pod["containers"] == [
        {
            "name": "node",
            "volumeMounts": [
                {"name": "run", "mountPath": str(tmp_path / "runs")},
                {"name": "shm", "mountPath": "/dev/shm"},
            ],
        }
    ]


@pytest.mark.parametrize(
    "more,words",
    [
        (["cluster.k8s.image=null"], ["cluster.k8s.image", "required"]),
        (["cluster.k8s.image='ghcr.io/me/t:1 && reboot'"], ["cluster.k8s.image", "letters, digits"]),
        (["cluster.k8s.volume_claim=null"], ["cluster.k8s.volume_claim", "ReadWriteMany"]),
        (["cluster.k8s.mount_path=/elsewhere"], ["hydra.run.dir", "cluster.k8s.mount_path=/elsewhere"]),
        (["cluster.k8s.namespace=Team_A"], ["cluster.k8s.namespace=Team_A", "a Kubernetes name"]),
        (['cluster.k8s.node_selector=["gpu"]'], ["cluster.k8s.node_selector=gpu", "key=value"]),
        (["cluster.k8s.tolerations=[{key: gpu, operator: Sometimes}]"], ["cluster.k8s.tolerations", "Equal or Exists"]),
        (["cluster.k8s.tolerations=[{key: gpu, effect: Never}]"], ["cluster.k8s.tolerations", "NoSchedule"]),
        (
            ["cluster.k8s.tolerations=[{key: gpu, value: 1}]"],
            ["cluster.k8s.tolerations", "quoted if it looks like a number"],
        ),
        (
            ["cluster.k8s.tolerations=[{key: gpu, operator: Exists, value: a}]"],
            ["cluster.k8s.tolerations", "none with operator Exists"],
        ),
        (
            ["cluster.k8s.tolerations=[{key: gpu, effect: NoSchedule, tolerationSeconds: 60}]"],
            ["tolerationSeconds", "NoExecute"],
        ),
        (["cluster.k8s.mount_path=/"], ["hydra.run.dir", "cluster.k8s.mount_path=/"]),
        (["cluster.preempt_grace_s=60"], ["cluster.preempt_grace_s=60", "shutdown_timeout_s=180"]),
        (["checkpoint.resume=never"], ["checkpoint.resume=never", "use auto"]),
    ],
)
def test_bad_values_are_one_line_and_exit_2(more, words, tmp_path, capsys):
    code = cli.main(["submit", *args(tmp_path / "runs" / "c", *more)])
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), err
    for w in words:
        assert w in lines[0], (w, lines[0])
    assert not (tmp_path / "runs" / "c").exists()


def test_train_refuses_a_kubernetes_config(tmp_path, capsys):
    assert cli.main(["train", *args(tmp_path / "runs" / "d")]) == 2
    assert "is a Kubernetes config: submit it with `make submit`" in capsys.readouterr().err


def test_submit_without_kubectl_writes_the_run_directory_and_says_the_command(tmp_path, capsys, monkeypatch):
    if shutil.which("kubectl"):  # this machine has none; elsewhere, hide it
        monkeypatch.setenv("PATH", str(tmp_path / "empty-bin"))
    run = tmp_path / "runs" / "e"
    assert cli.main(["submit", *args(run)]) == 0
    out = capsys.readouterr().out
    assert (
        f"kubectl is not on PATH: wrote {run / 'job.yaml'}; apply it with: kubectl apply -f {run / 'job.yaml'}" in out
    )
    docs = list(yaml.safe_load_all((run / "job.yaml").read_text()))
    assert [d["kind"] for d in docs] == ["Service", "Job"]
    assert (run / "config.yaml").is_file() and (run / "code" / "launcher" / "rank" / "entry.py").is_file()


def test_a_run_directory_named_by_the_time_still_gives_a_service_name():
    """The default run directory starts with the time (outputs/<date>/20-29-31-fsdp): a
    Service's name must start with a letter, and pod names add `-<index>` within 63."""
    import re

    for run in ("/shared/outputs/2026-11-26/20-29-31-fsdp", "/shared/runs/" + "x" * 80, "/shared/runs/__"):
        name = k8s.job_name(run)
        assert re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", name) and len(name) <= 56, name
    assert k8s.job_name("/shared/runs/a") != k8s.job_name("/shared/other/a")


@pytest.mark.skipif(sys.version_info < (3, 11), reason="the golden holds the snapshot's PYTHONSAFEPATH (3.11+)")
def test_the_rehearsed_405b_layout_renders_as_a_64_pod_job(capsys, monkeypatch):
    """The 405B layout scripts/rehearse_matrix.py rehearses at 512 ranks (docs/memory.md 5),
    pp=16 x tp=8 x fsdp, as a Kubernetes job: 64 pods of 8 GPUs, one torchrun agent a pod,
    the c10d rendezvous (the ranks' store) on pod 0 through the headless Service, every pod
    given cluster.join_timeout_s to join, the flight recorder's dump into the run directory;
    the same overrides as tests/unit/test_slurm.py's 64-node sbatch golden."""
    from golden import check_golden
    from runs import REPO

    from launcher.launch.rundir import prepare as rundir

    kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="the k8s extra (make test installs it)")
    monkeypatch.chdir(REPO)

    class ParallelFilesystem:  # 4 checkpoints of 6 TB on the cluster's shared volume
        free = 2**50

    monkeypatch.setattr(rundir.shutil, "disk_usage", lambda path: ParallelFilesystem)
    run = Path("/shared/runs/llama3-405b")  # fixed: the job's name and rendezvous id hash it
    assert (
        cli.main(
            [
                "submit",
                "model=llama3_405b",
                "recipe=pp_fsdp",
                "parallel.pp=16",
                "parallel.tp=8",
                "parallel.sequence_parallel=true",
                "parallel.pp_microbatches=32",
                "train.micro_batch=32",
                "cluster=k8s",
                "cluster.nnodes=64",
                "cluster.gpus_per_node=8",
                "cluster.join_timeout_s=900",
                "cluster.k8s.image=ghcr.io/me/train:1",
                "cluster.k8s.volume_claim=shared-runs",
                "cluster.k8s.mount_path=/shared",
                "cluster.k8s.namespace=llm",
                'cluster.k8s.node_selector=["nvidia.com/gpu.product=NVIDIA-H100-80GB-HBM3"]',
                "cluster.k8s.tolerations=[{key: nvidia.com/gpu, operator: Exists, effect: NoSchedule}]",
                "train.seq_len=8192",
                "train.activation_checkpointing=full",
                "+cluster.env.NCCL_SOCKET_IFNAME=eth0",
                f"hydra.run.dir={run}",
                "--dry-run",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert not run.exists(), "--dry-run wrote a run directory"
    check_golden("submit_dry_run_64_pods_405b.yaml", out.replace(str(REPO), "/repo"))
    service, job = yaml.safe_load_all(out)
    for obj in (service, job):
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    name = k8s.job_name(str(run))
    spec = job["spec"]
    assert (spec["completions"], spec["parallelism"], spec["backoffLimit"]) == (64, 64, 192)
    (container,) = spec["template"]["spec"]["containers"]
    assert container["resources"] == {"limits": {"nvidia.com/gpu": 8}}
    words = shlex.split(container["command"][2].replace("$$", "$"))
    assert "--nnodes=64" in words and "--nproc-per-node=8" in words and "--rdzv-backend=c10d" in words
    assert f"--rdzv-endpoint={name}-0.{name}:29500" in words
    assert "--rdzv-conf=join_timeout=900,is_host=$IS_HOST" in words
    env = {e["name"]: e["value"] for e in container["env"]}
    # The collectives' flight recorder, dumped into the run directory on a hang or an NCCL timeout.
    assert env["TORCH_FR_BUFFER_SIZE"] == "2000" and env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert env["TORCH_FR_DUMP_TEMP_FILE"] == f"{run}/comm_trace/rank_"
