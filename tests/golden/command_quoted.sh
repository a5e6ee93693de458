#!/usr/bin/env bash
# The exact command that trains '/runs/x; touch pwned $(touch pwned2) '"'"'q'"'"''.
# Run it again to resume from the latest checkpoint (checkpoint.resume=auto).
set -euo pipefail
cd '/home/me/my repo'
export OMP_NUM_THREADS=1
export TORCH_FR_BUFFER_SIZE=2000
export TORCH_FR_DUMP_TEMP_FILE='/runs/x; touch pwned $(touch pwned2) '"'"'q'"'"'/comm_trace/rank_'
export TORCH_NCCL_ASYNC_ERROR_HANDLING=3
export TORCH_NCCL_DUMP_ON_TIMEOUT=1
# A launch still running there: say so now (its rendezvous would keep this one waiting).
/opt/venv/bin/python -m launcher.runlock '/runs/x; touch pwned $(touch pwned2) '"'"'q'"'"''
# Supervised as `launcher train` supervises it: a Ctrl-C saves and exits 130 in one line.
exec /opt/venv/bin/python -m launcher.launch.start.supervise '/runs/x; touch pwned $(touch pwned2) '"'"'q'"'"'' /opt/venv/bin/python -m torch.distributed.run --nnodes=1 --nproc-per-node=2 --rdzv-backend=c10d --rdzv-endpoint=127.0.0.1:29512 --rdzv-id=run-e114b94b883d --rdzv-conf=join_timeout=600 --max-restarts=0 --signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1 --shutdown-timeout=300 -m launcher.rank '/runs/x; touch pwned $(touch pwned2) '"'"'q'"'"''
