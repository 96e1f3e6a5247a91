#!/usr/bin/env bash
# Launch a MindSpore training script on one node of a cluster with msrun.
# Arguments are positional, as in MindFormers' scripts/msrun_launcher.sh; every one after the
# command is optional and takes its default when omitted (pass the earlier ones to set a later one).
#
# Usage:
#   bash scripts/msrun_launcher.sh "python train_script.py --args" \
#       [WORKER_NUM] [LOCAL_WORKER] [MASTER_ADDR] [MASTER_PORT] [NODE_RANK] [LOG_DIR] [JOIN] [CLUSTER_TIME_OUT]
#
#   WORKER_NUM        total worker processes in the job (one per device)        default 8
#   LOCAL_WORKER      worker processes started on this node                     default WORKER_NUM
#   MASTER_ADDR       IP or host name of the scheduler (node 0)                 default 127.0.0.1
#   MASTER_PORT       scheduler port, the same on every node                    default 8118
#   NODE_RANK         index of this node, 0 .. nodes-1                          default 0
#   LOG_DIR           scheduler.log and worker_<i>.log go here                  default output/msrun_log
#   JOIN              True: wait for the workers and return their status        default False
#   CLUSTER_TIME_OUT  seconds to wait for every worker to join the cluster      default 7200
#
# Examples:
#   # one node, 8 Ascend devices
#   bash scripts/msrun_launcher.sh "python train.py --config configs/gpt_moe_tiny.yaml"
#   # two nodes x 8 devices: run on each node with its NODE_RANK
#   bash scripts/msrun_launcher.sh "python train.py" 16 8 192.168.1.10 8118 0 output/msrun_log False 300
#   bash scripts/msrun_launcher.sh "python train.py" 16 8 192.168.1.10 8118 1 output/msrun_log False 300
#   # this CPU machine: 2 local workers, wait for them (msrun runs the `python` first on PATH)
#   PATH=$PWD/.venv/bin:$PATH bash scripts/msrun_launcher.sh "python train.py" 2 2 127.0.0.1 8118 0 output/msrun_log True 60
set -euo pipefail

usage() {
  # The comment block at the top of this file, without the '# '.
  sed -n '2,/^set -euo/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//'
}

if [[ $# -ge 1 && ( "$1" == "-h" || "$1" == "--help" ) ]]; then
  usage
  exit 0
fi
if [[ $# -lt 1 || $# -gt 9 ]]; then
  usage >&2
  exit 1
fi

# msrun takes the script path and runs it with the `python` on PATH, so a leading interpreter
# word in the command is dropped.
read -r -a TASK <<< "$1"
if [[ ${#TASK[@]} -eq 0 ]]; then
  echo "error: the command is empty; expected \"python train_script.py --args\"." >&2
  exit 1
fi
if [[ "${TASK[0]}" == python* || "${TASK[0]}" == */python* ]]; then
  TASK=("${TASK[@]:1}")
fi
if [[ ${#TASK[@]} -eq 0 ]]; then
  echo "error: no script after '$1'; expected \"python train_script.py --args\"." >&2
  exit 1
fi

WORKER_NUM=${2:-8}
LOCAL_WORKER=${3:-$WORKER_NUM}
MASTER_ADDR=${4:-127.0.0.1}
MASTER_PORT=${5:-8118}
NODE_RANK=${6:-0}
LOG_DIR=${7:-output/msrun_log}
JOIN=${8:-False}
CLUSTER_TIME_OUT=${9:-7200}

for pair in "WORKER_NUM=$WORKER_NUM" "LOCAL_WORKER=$LOCAL_WORKER" "MASTER_PORT=$MASTER_PORT" "NODE_RANK=$NODE_RANK"; do
  if ! [[ "${pair#*=}" =~ ^[0-9]+$ ]]; then
    echo "error: '${pair%%=*}' must be a non-negative integer, but got '${pair#*=}'." >&2
    exit 1
  fi
done
if ! [[ "$CLUSTER_TIME_OUT" =~ ^-?[0-9]+$ ]]; then
  echo "error: 'CLUSTER_TIME_OUT' must be an integer (seconds, negative = wait forever), but got '$CLUSTER_TIME_OUT'." >&2
  exit 1
fi
if (( LOCAL_WORKER < 1 || LOCAL_WORKER > WORKER_NUM )); then
  echo "error: 'LOCAL_WORKER' must be in [1, WORKER_NUM=$WORKER_NUM], but got $LOCAL_WORKER." >&2
  exit 1
fi
if [[ "$JOIN" != "True" && "$JOIN" != "False" ]]; then
  echo "error: 'JOIN' must be True or False, but got '$JOIN'." >&2
  exit 1
fi
if ! command -v msrun > /dev/null; then
  echo "error: msrun is not on PATH; install mindspore or put its environment's bin first on PATH." >&2
  exit 1
fi

echo "msrun launcher:"
echo "  script           ${TASK[*]}"
echo "  python           $(command -v python || echo 'not on PATH')"
echo "  WORKER_NUM       $WORKER_NUM"
echo "  LOCAL_WORKER     $LOCAL_WORKER"
echo "  MASTER_ADDR      $MASTER_ADDR"
echo "  MASTER_PORT      $MASTER_PORT"
echo "  NODE_RANK        $NODE_RANK"
echo "  LOG_DIR          $LOG_DIR"
echo "  JOIN             $JOIN"
echo "  CLUSTER_TIME_OUT $CLUSTER_TIME_OUT"

mkdir -p "$LOG_DIR"
exec msrun --worker_num="$WORKER_NUM" \
  --local_worker_num="$LOCAL_WORKER" \
  --master_addr="$MASTER_ADDR" \
  --master_port="$MASTER_PORT" \
  --node_rank="$NODE_RANK" \
  --log_dir="$LOG_DIR" \
  --join="$JOIN" \
  --cluster_time_out="$CLUSTER_TIME_OUT" \
  "${TASK[@]}"
