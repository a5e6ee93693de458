#!/usr/bin/env bash
# scripts/slurm/local_cluster.sh [DIR]
#
# A real single-node Slurm (Debian's slurm-wlm 22.05 and munge) in a folder, without
# systemd and without touching /etc: munged with its own key and socket, slurmctld and
# slurmd in the foreground as children of this script. It prints the line to paste into
# another shell, writes DIR/ready once the node takes jobs, and runs until Ctrl-C /
# SIGTERM; then it stops exactly the daemons it started, by PID:
#   scancel the jobs -> wait until no step is left (slurmstepd outlives slurmd)
#   -> SIGTERM slurmctld and slurmd -> munged last.
#
#   scripts/slurm/local_cluster.sh &          # or in its own terminal
#   export SLURM_CONF=/tmp/slurm-XXXX/slurm.conf
#   make submit ARGS="cluster=slurm cluster.nproc_per_node=2 train.steps=50"
#
# The test fixture (tests/helpers/slurm_cluster.py) runs this same script.
# Needs: apt-get install -y --no-install-recommends slurm-wlm munge
set -euo pipefail

for tool in munged mungekey slurmctld slurmd scontrol squeue scancel sinfo python3; do
    command -v "$tool" >/dev/null || { echo "error: $tool not found; apt-get install -y --no-install-recommends slurm-wlm munge" >&2; exit 2; }
done

# munged checks that every folder above its socket is searchable by others: under /tmp,
# mode 755 (pytest's tmp_path has 0700 parents, which munged refuses).
DIR=${1:-$(mktemp -d /tmp/slurm-XXXXXX)}
mkdir -p "$DIR"
DIR=$(cd "$DIR" && pwd)
chmod 755 "$DIR"
mkdir -p "$DIR"/{munge,state,spool,log}
rm -f "$DIR/ready"

ME=$(id -un)
# Two free ports (not Slurm's defaults, so a system Slurm or a second copy can coexist).
read -r CTLD_PORT SLURMD_PORT < <(python3 - <<'EOF'
import socket
socks = [socket.socket() for _ in range(2)]
for s in socks:
    s.bind(("127.0.0.1", 0))
print(*(s.getsockname()[1] for s in socks))
EOF
)
CPUS=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)  # the cores (nproc alone counts OMP_NUM_THREADS)
MEM_MB=$(awk '/MemTotal/ {print int($2 / 1024) - 1024}' /proc/meminfo)  # the node's memory minus 1 GiB

SOCKET=$DIR/munge/munge.socket.2
mungekey -c -f -k "$DIR/munge/munge.key"
chmod 600 "$DIR/munge/munge.key"
touch "$DIR/plugstack.conf"

cat > "$DIR/slurm.conf" <<EOF
# A single-node Slurm made by scripts/slurm/local_cluster.sh (not for production).
ClusterName=launcher-local
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
SlurmUser=$ME
SlurmdUser=$ME
AuthType=auth/munge
# cred_expire: a requeued job waits this long + 1 s before it may start again (120 s by
# default; short here so a preemption test does not idle for two minutes).
AuthInfo=socket=$SOCKET,cred_expire=5
CredType=cred/munge
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.log
PlugStackConfig=$DIR/plugstack.conf
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/builtin
# Start jobs at once, and look at pending (requeued) jobs every second, not every minute.
SchedulerParameters=batch_sched_delay=0,sched_interval=1
MailProg=/bin/true
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
ReturnToService=2
# Finished jobs stay visible to scontrol show job this long (there is no sacct here).
MinJobAge=600
KillWait=30
NodeName=localhost NodeAddr=127.0.0.1 CPUs=$CPUS RealMemory=$MEM_MB State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP
EOF
export SLURM_CONF=$DIR/slurm.conf

PIDS=()
MUNGED= CTLD= SLURMD=
stop() {
    trap - EXIT INT TERM
    if [[ -n $CTLD ]]; then
        # Cancel the jobs, then wait for their steps to end: slurmstepd outlives slurmd.
        local jobs
        jobs=$(squeue -h -o %i 2>/dev/null || true)
        [[ -n $jobs ]] && scancel $jobs 2>/dev/null || true
        for _ in $(seq 1 120); do
            [[ -z $(squeue -h -o %i 2>/dev/null || true) ]] && \
                ! compgen -G "$DIR/spool/*_[0-9]*.*" >/dev/null && break
            sleep 0.5
        done
    fi
    for pid in $CTLD $SLURMD; do kill -TERM "$pid" 2>/dev/null || true; done
    for pid in $CTLD $SLURMD; do wait "$pid" 2>/dev/null || true; done
    if [[ -n $MUNGED ]]; then kill -TERM "$MUNGED" 2>/dev/null || true; wait "$MUNGED" 2>/dev/null || true; fi
    rm -f "$DIR/ready"
    echo "local Slurm in $DIR stopped"
}
trap stop EXIT
trap 'exit 0' INT TERM

# Each daemon in its own session (setsid execs in place, so $! is its PID): a Ctrl-C in
# this terminal reaches only this script, which then stops them in order.
setsid munged --foreground --force --socket="$SOCKET" --key-file="$DIR/munge/munge.key" \
    --pid-file="$DIR/munge/munged.pid" --log-file="$DIR/log/munged.log" --seed-file="$DIR/munge/munged.seed" 2>"$DIR/log/munged.out" &
MUNGED=$!
for _ in $(seq 1 100); do [[ -S $SOCKET ]] && break; sleep 0.1; done
[[ -S $SOCKET ]] || { echo "error: munged did not start; see $DIR/log/munged.log" >&2; exit 1; }

setsid slurmctld -D -i -f "$SLURM_CONF" >"$DIR/log/slurmctld.out" 2>&1 &
CTLD=$!
setsid slurmd -D -N localhost -f "$SLURM_CONF" >"$DIR/log/slurmd.out" 2>&1 &
SLURMD=$!

# Ready when the node is idle (about 1 s).
for _ in $(seq 1 120); do
    state=$(sinfo -h -n localhost -o %T 2>/dev/null || true)
    [[ $state == idle ]] && break
    for pid in $MUNGED $CTLD $SLURMD; do
        kill -0 "$pid" 2>/dev/null || { echo "error: a daemon exited; see $DIR/log/" >&2; exit 1; }
    done
    sleep 0.5
done
[[ ${state:-} == idle ]] || { echo "error: the node never became idle (state: ${state:-none}); see $DIR/log/" >&2; exit 1; }

echo "$MUNGED $CTLD $SLURMD" > "$DIR/pids"
echo "local Slurm ready: $CPUS CPUs, ${MEM_MB} MB on node localhost, partition debug"
echo "export SLURM_CONF=$SLURM_CONF"
touch "$DIR/ready"
# Run until stopped; a daemon that dies ends the cluster.
wait -n "$MUNGED" "$CTLD" "$SLURMD" || true
echo "error: a daemon exited; see $DIR/log/" >&2
exit 1
