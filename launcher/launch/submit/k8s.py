"""Kubernetes (cluster=k8s): RUN_DIR/job.yaml for `make submit`, and kubectl.

Two flavours (cluster.k8s.kind):
- job: an Indexed batch/v1 Job (one pod per node, completion index = node rank) and a
  headless Service, so pod 0 has a DNS name (`<job>-0.<job>`) for the c10d rendezvous. No
  operator needed.
- trainjob: a Kubeflow Trainer TrainJob on a torch runtime; the operator builds the pods
  and gives each its node rank and the rendezvous address (PET_* variables).

Each pod runs torchrun for its node, like a Slurm task (launch/start/argv.py::torchrun_argv):
the run directory is on a shared volume at the same path as on the submitting machine, so
a pod that fails or is evicted restarts and its ranks resume from `latest`. The manifest is
YAML written by a YAML emitter from plain data (no text templating); the one shell line in
it quotes every value (shell_word), and names, labels and tolerations are checked here.
"""

from __future__ import annotations

import hashlib
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import yaml

from launcher import config as C
from launcher import user_env
from launcher.launch.start.argv import NodeArgs, ShellExpr, job_env, shell_word, torchrun_argv

MANIFEST = "job.yaml"
PORT = 29500
_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
_LABEL_KEY = re.compile(r"([a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?")
_LABEL_VALUE = re.compile(r"([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?")
_IMAGE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/:@-]*")
_TOLERATION = {"key", "operator", "value", "effect", "tolerationSeconds"}
_EFFECTS = {"NoSchedule", "PreferNoSchedule", "NoExecute"}


def job_name(run_dir: str) -> str:
    """A DNS label from the run directory's last part and a digest of its path: the same
    for every submit of one run directory, different for two (pod names add `-<index>-x`)."""
    base = re.sub(r"[^a-z0-9-]+", "-", Path(run_dir).name.lower()).strip("-")[:40].strip("-")
    if not base[:1].isalpha():  # a Service's name starts with a letter (the default run name starts with the time)
        base = f"run-{base}".rstrip("-")
    return f"{base}-{hashlib.sha1(run_dir.encode()).hexdigest()[:8]}"


def validate_k8s_pods(cfg: C.Config, run_dir: Path) -> None:
    """What the pods need: a printable run directory, tolerations, limits, a grace the save fits in, resume=auto."""
    c, k = cfg.cluster, cfg.cluster.k8s
    if not str(run_dir).isprintable():  # YAML reads \x85, \u2028 and \u2029 as line breaks
        raise C.ConfigError("hydra.run.dir", ascii(str(run_dir)), "a Kubernetes job's run directory is printable text")
    for t in k.tolerations:
        _check_toleration(t)
    if not 0 <= k.backoff_limit <= 1000:
        raise C.ConfigError("cluster.k8s.backoff_limit", k.backoff_limit, "must be in 0..1000")
    if k.shm_gb < 1:
        raise C.ConfigError("cluster.k8s.shm_gb", k.shm_gb, "must be >= 1 (GiB of /dev/shm per pod)")
    if not 1 <= c.preempt_grace_s <= 65535 or c.preempt_grace_s < c.shutdown_timeout_s:
        raise C.ConfigError(
            "cluster.preempt_grace_s",
            c.preempt_grace_s,
            f"must be in 1..65535 and >= "
            f"cluster.shutdown_timeout_s={c.shutdown_timeout_s} (the ranks' save fits in the grace)",
        )
    if c.local_addr is not None:
        raise C.ConfigError("cluster.local_addr", c.local_addr, "each pod has its own address: leave it null")
    if cfg.checkpoint.resume != "auto":
        raise C.ConfigError(
            "checkpoint.resume",
            cfg.checkpoint.resume,
            "a restarted pod must resume from the run's latest checkpoint: use auto",
        )


def validate_k8s(cfg: C.Config, run_dir: Path) -> None:
    """The Kubernetes fields, each wrong value one line (exit 2) before anything is written."""
    k = cfg.cluster.k8s
    if not k.image or not _IMAGE.fullmatch(k.image):
        raise C.ConfigError(
            "cluster.k8s.image",
            k.image,
            "required: the container image the pods run, e.g. ghcr.io/me/train:1 (letters, digits and ._/:@- only)",
        )
    if not re.fullmatch(r"[\w./+-]+", k.python):
        raise C.ConfigError("cluster.k8s.python", k.python, "the image's interpreter: a command name or a path")
    for key in ("namespace", "service_account", "volume_claim"):
        value = getattr(k, key)
        if value is not None and not _DNS_LABEL.fullmatch(value):
            raise C.ConfigError(
                f"cluster.k8s.{key}",
                value,
                "a Kubernetes name: lower-case letters, digits and -, at most 63 characters",
            )
    if k.context is not None and not re.fullmatch(r"[\w.:@/-]+", k.context):
        raise C.ConfigError("cluster.k8s.context", k.context, "a kubectl context name: letters, digits and ._:@/- only")
    if k.volume_claim is None:
        raise C.ConfigError(
            "cluster.k8s.volume_claim",
            None,
            "required: a ReadWriteMany PersistentVolumeClaim for the "
            "run directory (a restarted pod resumes from its checkpoints)",
        )
    mount = Path(k.mount_path)
    if not mount.is_absolute() or mount in (Path("/"), Path("/dev/shm")) or not run_dir.is_relative_to(mount):
        raise C.ConfigError(
            "hydra.run.dir",
            str(run_dir),
            f"a Kubernetes job's run directory lies under "
            f"cluster.k8s.mount_path={k.mount_path} (the shared volume, the same path here and in the pods)",
        )
    for entry in k.node_selector:
        key, eq, value = str(entry).partition("=")
        if not eq or not _LABEL_KEY.fullmatch(key) or not _LABEL_VALUE.fullmatch(value):
            raise C.ConfigError(
                "cluster.k8s.node_selector",
                entry,
                "each entry key=value, a Kubernetes label: key [prefix/]name, value up to 63 letters, digits and -_.",
            )
    validate_k8s_pods(cfg, run_dir)


def _check_toleration(t) -> None:
    """One toleration as the API server takes it, or one line saying what is wrong."""

    def bad(why: str) -> C.ConfigError:
        return C.ConfigError("cluster.k8s.tolerations", t, why)

    if not isinstance(t, dict) or not set(t) <= _TOLERATION:
        raise bad(f"each a mapping of {', '.join(sorted(_TOLERATION))}")
    operator = t.get("operator", "Equal")
    if operator not in ("Equal", "Exists"):
        raise bad("operator Equal or Exists")
    if "key" in t and not (isinstance(t["key"], str) and _LABEL_KEY.fullmatch(t["key"])):
        raise bad("key: a Kubernetes label name")
    if "value" in t and (
        operator == "Exists" or not isinstance(t["value"], str) or not _LABEL_VALUE.fullmatch(t["value"])
    ):
        raise bad("value: a label value (text, quoted if it looks like a number), and none with operator Exists")
    if "effect" in t and t["effect"] not in _EFFECTS:
        raise bad(f"effect: one of {', '.join(sorted(_EFFECTS))}")
    if "tolerationSeconds" in t and (
        t.get("effect") != "NoExecute" or type(t["tolerationSeconds"]) is not int or t["tolerationSeconds"] < 0
    ):
        raise bad("tolerationSeconds: whole seconds >= 0, with effect NoExecute")


def node_script(cfg: C.Config, run_dir: str, plan) -> str:
    """The pod's shell line: into the run directory, then torchrun for this node. Node
    count, rank and pod 0's address come from the pod (the completion index and the
    Service's DNS, or the Trainer's PET_* variables); everything else is quoted."""
    if cfg.cluster.k8s.kind == C.K8sKind.trainjob:
        rank = "PET_NODE_RANK"
        node = NodeArgs(
            ShellExpr('"$PET_NNODES"'), ShellExpr(f'"${rank}"'), ShellExpr('"$PET_MASTER_ADDR:$PET_MASTER_PORT"')
        )
    else:
        name, rank = job_name(run_dir), "JOB_COMPLETION_INDEX"
        node = NodeArgs(
            str(cfg.cluster.nnodes), ShellExpr(f'"${rank}"'), f"{name}-0.{name}:{cfg.cluster.master_port or PORT}"
        )
    # Node 0 hosts the rendezvous store, said outright: torchrun would otherwise decide by
    # resolving pod 0's DNS name, which may not exist yet when the pod starts.
    argv = [
        ShellExpr(f'{a},is_host="$IS_HOST"') if a.startswith("--rdzv-conf=") else a
        for a in torchrun_argv(cfg, run_dir, plan, node)
    ]
    return f'IS_HOST=false; [ "${rank}" = 0 ] && IS_HOST=true; cd {shlex.quote(run_dir)} && exec ' + " ".join(
        shell_word(a) for a in argv
    )


def literal(text: str) -> str:
    """Text for a container's command or env value: Kubernetes expands $(NAME) there and
    reduces $$ to $, so every $ is doubled (the shell still sees "$JOB_COMPLETION_INDEX")."""
    return text.replace("$", "$$")


def _env(cfg: C.Config, run_dir: str, plan) -> list[dict]:
    return [{"name": k, "value": literal(v)} for k, v in sorted(job_env(cfg, plan, run_dir).items())]


def _volumes(k) -> tuple[list[dict], list[dict]]:
    volumes = [
        {"name": "run", "persistentVolumeClaim": {"claimName": k.volume_claim}},
        {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": f"{k.shm_gb}Gi"}},
    ]
    mounts = [{"name": "run", "mountPath": k.mount_path}, {"name": "shm", "mountPath": "/dev/shm"}]
    return volumes, mounts


def _resources(cfg: C.Config) -> dict:
    gpus = cfg.cluster.gpus_per_node
    return {"limits": {"nvidia.com/gpu": gpus}} if gpus else {}


def _placement(cfg: C.Config) -> dict:
    """Where the pods may run and how long they get after SIGTERM."""
    k = cfg.cluster.k8s
    spec: dict = {"terminationGracePeriodSeconds": cfg.cluster.preempt_grace_s}
    if k.node_selector:
        spec["nodeSelector"] = dict(str(e).split("=", 1) for e in k.node_selector)
    if k.tolerations:
        spec["tolerations"] = [dict(t) for t in k.tolerations]
    if k.service_account:
        spec["serviceAccountName"] = k.service_account
    return spec


def trainjob(cfg: C.Config, run_dir: str, plan, meta: dict, command: list, volumes: list, mounts: list) -> dict:
    """cluster.k8s.kind=trainjob: one Kubeflow TrainJob on the torch-distributed runtime, patched
    with the pods' placement and the shared volume."""
    k = cfg.cluster.k8s
    patch = {**_placement(cfg), "volumes": volumes, "containers": [{"name": "node", "volumeMounts": mounts}]}
    template = {"spec": {"replicatedJobs": [{"name": "node", "template": {"spec": {"template": {"spec": patch}}}}]}}
    trainer = {
        "image": k.image,
        "command": command,
        "env": _env(cfg, run_dir, plan),
        "numNodes": cfg.cluster.nnodes,
        "numProcPerNode": plan.nproc_per_node,
    }
    if _resources(cfg):
        trainer["resourcesPerNode"] = _resources(cfg)
    return {
        "apiVersion": "trainer.kubeflow.org/v1alpha1",
        "kind": "TrainJob",
        "metadata": meta,
        "spec": {
            "runtimeRef": {"name": "torch-distributed"},
            "trainer": trainer,
            "runtimePatches": [{"manager": "launcher", "trainingRuntimeSpec": {"template": template}}],
        },
    }


def manifests(cfg: C.Config, run_dir: str, plan) -> list[dict]:
    """The objects job.yaml holds, in the order kubectl applies them."""
    k, name = cfg.cluster.k8s, job_name(run_dir)
    labels = {"app.kubernetes.io/name": "launcher", "launcher/job": name}
    meta = {"name": name, "namespace": k.namespace, "labels": labels}
    command = ["bash", "-c", literal(node_script(cfg, run_dir, plan))]
    volumes, mounts = _volumes(k)
    if k.kind == C.K8sKind.trainjob:
        return [trainjob(cfg, run_dir, plan, meta, command, volumes, mounts)]
    container = {
        "name": "node",
        "image": k.image,
        "command": command,
        "env": _env(cfg, run_dir, plan),
        "volumeMounts": mounts,
        "resources": _resources(cfg),
    }
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {**meta, "labels": dict(labels)},
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": {"launcher/job": name},
            "ports": [{"name": "rendezvous", "port": cfg.cluster.master_port or PORT}],
        },
    }
    pod = {
        "metadata": {"labels": dict(labels)},  # a copy: the YAML holds no anchors
        "spec": {
            **_placement(cfg),
            "subdomain": name,
            "restartPolicy": "OnFailure",
            "containers": [container],
            "volumes": volumes,
        },
    }
    job = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": meta,
        "spec": {
            "completionMode": "Indexed",
            "completions": cfg.cluster.nnodes,
            "parallelism": cfg.cluster.nnodes,
            "backoffLimit": k.backoff_limit * cfg.cluster.nnodes,
            "template": pod,
        },
    }
    return [service, job]


def render(cfg: C.Config, run_dir: str, plan) -> str:
    head = f"# Kubernetes job for the run directory {run_dir}; apply with: {shlex.join(apply_argv(cfg, run_dir))}\n"
    return head + yaml.safe_dump_all(manifests(cfg, run_dir, plan), sort_keys=False, width=120)


def apply_argv(cfg: C.Config, run_dir: str) -> list[str]:
    context = cfg.cluster.k8s.context
    return ["kubectl", *(["--context", context] if context else []), "apply", "-f", str(Path(run_dir) / MANIFEST)]


def apply(cfg: C.Config, run_dir: Path) -> str:
    """`kubectl apply -f RUN_DIR/job.yaml` when kubectl and a context are there; else the
    command to run, in words. kubectl runs with the user's environment (KUBECONFIG)."""
    argv = apply_argv(cfg, str(run_dir))
    command = " ".join(shlex.quote(a) for a in argv)
    if shutil.which("kubectl") is None:
        return f"kubectl is not on PATH: wrote {run_dir / MANIFEST}; apply it with: {command}"
    name = cfg.cluster.k8s.context
    check = ["kubectl", "config", "get-contexts", name] if name else ["kubectl", "config", "current-context"]
    context = subprocess.run(check, capture_output=True, text=True, env=user_env())
    if context.returncode != 0:
        return f"kubectl has no context here: wrote {run_dir / MANIFEST}; apply it with: {command}"
    proc = subprocess.run(argv, capture_output=True, text=True, env=user_env())
    if proc.returncode != 0:
        lines = [ln.strip() for ln in (proc.stderr or proc.stdout).splitlines() if ln.strip()]
        raise SubmitError(" | ".join(lines) or f"kubectl exited {proc.returncode}")
    said = proc.stdout.strip()
    if " unchanged" in said:  # a Job's pods run once: the same Job applied again starts nothing
        return (
            f"kubectl left the job as it was ({said}): it exists already; to start it again, first: "
            f"{shlex.join(['kubectl', *argv[1:-3], 'delete', '-f', argv[-1]])}"
        )
    return f"applied {run_dir / MANIFEST} ({said})"


class SubmitError(Exception):
    """kubectl refused the manifest; the message is kubectl's own."""
