#!/usr/bin/env bash
# A one-node Slurm cluster on this host, for trying `srun`/`sbatch` launches of quilt without
# a real cluster (and for the Slurm tests of `make test`).
#
#   tools/slurm-local.sh start            # install if missing, configure, start, wait until idle
#   tools/slurm-local.sh run -- CMD ...   # start, run CMD with SLURM_CONF set, stop (also on failure)
#   tools/slurm-local.sh stop             # stop the daemons this script started
#   tools/slurm-local.sh env              # print `export SLURM_CONF=...` for a shell
#
# Everything lives under $QUILT_SLURM_DIR (default /tmp/quilt-slurm): slurm.conf, a private
# munge key and socket, spool and state directories, logs and pid files. Nothing under /etc is
# changed and no system service is used, so it can run beside (or instead of) a system Slurm;
# clients find the cluster through SLURM_CONF. Needs root (slurmd runs jobs as any user, and
# apt-get installs slurm-wlm and munge when they are missing).
#
# The node is this host with its real CPU count; the partition lets jobs overcommit
# (OverSubscribe=FORCE and srun/sbatch --overcommit), so `srun -n 4` runs on 2 CPUs. Processes
# are tracked without cgroups (proctrack/linuxproc, task/none), so it also works in containers.
# MPI: Debian 12's slurm-wlm 22.05 ships the mpi plugins none, pmi2, pmix and pmix_v4 (`srun
# --mpi=list`); its OpenMPI 4.1 is built against the same PMIx 4 (libpmix2), so `srun
# --mpi=pmix` bootstraps MPI_Init directly. MpiDefault=pmix makes that the default here.
set -euo pipefail
dir=${QUILT_SLURM_DIR:-/tmp/quilt-slurm}
conf=$dir/slurm.conf
say() { echo "slurm-local: $*"; }
die() { echo "slurm-local: error: $*" >&2; exit 1; }

install_if_missing() {
  local missing=()
  for p in slurm-wlm munge; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  # 77: ctest's skip code (tests/slurm.cmake) where neither the packages nor root are there.
  [ "$(id -u)" -eq 0 ] || { echo "slurm-local: ${missing[*]} missing and not root: cannot install them" >&2; exit 77; }
  say "installing Debian packages: ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" > /dev/null
}

# A daemon's pid from its pid file, if that process is alive.
alive() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

write_conf() {
  local host cpus plugins
  host=$(hostname -s)
  cpus=$(nproc --all)
  plugins=$(ls /usr/lib/x86_64-linux-gnu/slurm-wlm/ 2>/dev/null | sed -n 's/^mpi_\(.*\)\.so$/\1/p' | tr '\n' ' ')
  case " $plugins " in *" pmix "*) mpi=pmix ;; *" pmi2 "*) mpi=pmi2 ;; *) mpi=none ;; esac
  cat > "$conf" <<EOF
# Written by tools/slurm-local.sh for $host ($cpus CPUs); MPI plugins found: $plugins
ClusterName=quilt-local
SlurmctldHost=$host
SlurmUser=root
SlurmctldPort=${QUILT_SLURM_PORT:-16817}
SlurmdPort=$(( ${QUILT_SLURM_PORT:-16817} + 1 ))
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$dir/munge/munge.socket
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SwitchType=switch/none
MpiDefault=$mpi
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
SchedulerType=sched/builtin
KillWait=5
InactiveLimit=0
MinJobAge=30
NodeName=$host CPUs=$cpus State=UNKNOWN
PartitionName=local Nodes=$host Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:8
EOF
}

start() {
  install_if_missing
  mkdir -p "$dir"/{munge,state,spool}
  chmod 700 "$dir/munge"
  export SLURM_CONF=$conf
  if alive "$dir/slurmctld.pid" && alive "$dir/slurmd.pid" && alive "$dir/munge/munged.pid"; then
    say "already running ($conf)"
    return 0
  fi
  stop > /dev/null 2>&1 || true
  write_conf
  # A private munge instance: its own key and socket (the system's, if any, is left alone).
  [ -f "$dir/munge/munge.key" ] || { dd if=/dev/urandom of="$dir/munge/munge.key" bs=1024 count=1 status=none; chmod 400 "$dir/munge/munge.key"; }
  munged --force --socket="$dir/munge/munge.socket" --key-file="$dir/munge/munge.key" \
    --pid-file="$dir/munge/munged.pid" --log-file="$dir/munge/munged.log" --seed-file="$dir/munge/munged.seed" ||
    die "munged did not start (see $dir/munge/munged.log)"
  slurmctld -f "$conf" -c -i || die "slurmctld did not start (see $dir/slurmctld.log)"
  slurmd -f "$conf" -c || die "slurmd did not start (see $dir/slurmd.log)"
  local state=""
  for _ in $(seq 1 120); do
    state=$(sinfo -h -N -o '%t' 2>/dev/null | head -1 || true)
    case "$state" in idle*|mix*|alloc*) say "node $(hostname -s) is $state ($conf)"; return 0 ;; esac
    sleep 0.25
  done
  tail -n 20 "$dir/slurmctld.log" "$dir/slurmd.log" >&2 || true
  die "the node did not become idle within 30 s (state: ${state:-none})"
}

stop() {
  local f pid
  for f in "$dir/slurmd.pid" "$dir/slurmctld.pid" "$dir/munge/munged.pid"; do
    alive "$f" || continue
    pid=$(cat "$f")
    kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 1 40); do kill -0 "$pid" 2>/dev/null || break; sleep 0.125; done
    kill -0 "$pid" 2>/dev/null && kill -KILL "$pid" 2>/dev/null || true
    rm -f "$f"
  done
  # Jobs' state from this run must not come back in the next one.
  rm -rf "$dir/state" "$dir/spool"
  say "stopped"
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  env) echo "export SLURM_CONF=$conf" ;;
  run)
    shift
    [ "${1:-}" = "--" ] && shift
    [ $# -gt 0 ] || die "run needs a command: slurm-local.sh run -- CMD ..."
    trap 'stop > /dev/null 2>&1' EXIT
    trap 'exit 130' INT TERM
    start
    export SLURM_CONF=$conf
    set +e
    "$@"
    rc=$?
    exit $rc ;;
  *) echo "usage: slurm-local.sh start | stop | env | run -- CMD ..." >&2; exit 2 ;;
esac
