#!/usr/bin/env bash
# fsdpjob dev cluster: a real local Slurm cluster (munge, optional MariaDB + slurmdbd, slurmctld,
# N slurmd "n1".."nN" (default 2, at most 8) with 2 fake GPUs each) living in one state dir, for tests and users.
#
#   cluster.sh up     [--state-dir DIR] [--no-accounting] [--port-base N] [--nodes N]
#   cluster.sh down   [--state-dir DIR] [--purge]
#   cluster.sh status [--state-dir DIR]
#
# State dir default: ${FSDPJOB_DEVCLUSTER_DIR:-/tmp/fsdpjob-devcluster}. Needs root (SlurmUser=root).
#
# Ports, from the port base B: slurmctld B, slurmdbd B+1, MariaDB B+2, slurmd nK B+2+K (n1..n8: B+3..B+10).
# The node ports come last so that more nodes never move the others; 11 ports at most, so clusters whose
# bases are 20 apart (the test suite's) never overlap.
# Partitions: debug (default, preemptible) and high on n[1-2] whatever N is, so that a 3-node job there can
# never run (tests rely on it); with N > 2 also `wide` on n[1-N], for jobs that need spare nodes.
# stdout carries only results (`export SLURM_CONF=...`, the status report); diagnostics go to stderr.
set -euo pipefail

PATH="/usr/sbin:/sbin:${PATH}"
readonly DEFAULT_PORT_BASE=16810
readonly DEFAULT_NODES=2
readonly MAX_NODES=8  # each slurmd is a daemon on this one host; the port map has room for 8
readonly CLUSTER_NAME=fsdpjob
readonly PACKAGES_BASE=(slurmctld slurmd slurm-client munge)
readonly PACKAGES_ACCOUNTING=(slurmdbd mariadb-server)
readonly PACKAGES_TOOLS=(shellcheck bubblewrap mmdebstrap)  # rendered scripts are linted by shellcheck; mmdebstrap builds the test image, bwrap runs it
readonly UP_TIMEOUT_S=60
readonly DRAIN_TIMEOUT_S=25

readonly T0_US=${EPOCHREALTIME//[.,]/}
# Diagnostics carry the time since start, so slow steps show in CI logs.
say() {
    local ms=$(((${EPOCHREALTIME//[.,]/} - T0_US) / 1000))
    printf '[%d.%03ds] %s\n' $((ms / 1000)) $((ms % 1000)) "$*" >&2
}
die() { printf 'cluster.sh: %s\n' "$*" >&2; exit 1; }

usage() {
    cat >&2 <<'EOF'
usage: cluster.sh up     [--state-dir DIR] [--no-accounting] [--port-base N] [--nodes N]
       cluster.sh down   [--state-dir DIR] [--purge]
       cluster.sh status [--state-dir DIR]
       cluster.sh packages [--no-accounting]   (install what the cluster and the test suite need)
State dir default: ${FSDPJOB_DEVCLUSTER_DIR:-/tmp/fsdpjob-devcluster}.
EOF
}

# ---------------------------------------------------------------- arguments and layout

COMMAND=""
STATE_DIR="${FSDPJOB_DEVCLUSTER_DIR:-/tmp/fsdpjob-devcluster}"
ACCOUNTING=1
PORT_BASE=""
PURGE=0
NODES=""

parse_args() {
    [[ $# -ge 1 ]] || { usage; exit 2; }
    COMMAND=$1
    shift
    case "${COMMAND}" in
        up | down | status | packages) ;;
        -h | --help) usage; exit 0 ;;
        *) usage; die "unknown command '${COMMAND}' (use up, down, status or packages)" ;;
    esac
    while [[ $# -gt 0 ]]; do
        case "$1" in
            --state-dir) [[ $# -ge 2 ]] || die "--state-dir needs a value"; STATE_DIR=$2; shift 2 ;;
            --state-dir=*) STATE_DIR=${1#*=}; shift ;;
            --no-accounting) ACCOUNTING=0; shift ;;
            --port-base) [[ $# -ge 2 ]] || die "--port-base needs a value"; PORT_BASE=$2; shift 2 ;;
            --port-base=*) PORT_BASE=${1#*=}; shift ;;
            --nodes) [[ $# -ge 2 ]] || die "--nodes needs a value"; NODES=$2; shift 2 ;;
            --nodes=*) NODES=${1#*=}; shift ;;
            --purge) PURGE=1; shift ;;
            -h | --help) usage; exit 0 ;;
            *) usage; die "unknown option '$1' for ${COMMAND}" ;;
        esac
    done
    if [[ -n "${PORT_BASE}" ]] && ! [[ "${PORT_BASE}" =~ ^[0-9]+$ && PORT_BASE -ge 1024 && PORT_BASE -le 65000 ]]; then
        die "--port-base must be a number from 1024 to 65000, got '${PORT_BASE}'"
    fi
    if [[ -n "${NODES}" ]] && ! [[ "${NODES}" =~ ^[0-9]+$ && NODES -ge 2 && NODES -le MAX_NODES ]]; then
        die "--nodes must be a number from 2 to ${MAX_NODES}, got '${NODES}'"
    fi
    [[ -n "${STATE_DIR}" ]] || die "the state dir is empty (set --state-dir or FSDPJOB_DEVCLUSTER_DIR)"
    STATE_DIR=$(realpath -m -- "${STATE_DIR}")
    # slurm.conf and the munge/mariadb options cannot quote paths.
    [[ "${STATE_DIR}" =~ ^/[A-Za-z0-9._/+-]*$ ]] ||
        die "state dir '${STATE_DIR}' may only contain letters, digits and . _ / + - (slurm.conf cannot quote paths)"
    [[ "${STATE_DIR}" != / ]] || die "the state dir must not be /"
}

set_layout() {
    ETC="${STATE_DIR}/etc"
    RUN="${STATE_DIR}/run"
    LOG="${STATE_DIR}/log"
    SPOOL="${STATE_DIR}/spool"
    DEV="${STATE_DIR}/dev"
    MUNGE_DIR="${STATE_DIR}/munge"
    MUNGE_SOCK="${MUNGE_DIR}/munge.sock"
    DB_DIR="${STATE_DIR}/db"
    DB_SOCK="${RUN}/mysqld.sock"
    SLURM_CONF_FILE="${ETC}/slurm.conf"
    MODE_FILE="${STATE_DIR}/cluster.env"
    export SLURM_CONF="${SLURM_CONF_FILE}"
}

set_ports() {
    CTLD_PORT=$((PORT_BASE))
    DBD_PORT=$((PORT_BASE + 1))
    DB_PORT=$((PORT_BASE + 2))
}

node_port() { printf '%d' $((PORT_BASE + 2 + $1)); }

# node_names: n1 .. nN, one a line.
node_names() { local i; for ((i = 1; i <= NODES; i++)); do printf 'n%d\n' "${i}"; done; }

# The mode file records how the cluster was brought up, so status/down/up-again agree with it.
read_mode() {
    REC_ACCOUNTING=""
    REC_PORT_BASE=""
    REC_NODES=""
    [[ -f "${MODE_FILE}" ]] || return 0
    local key value
    while IFS='=' read -r key value; do
        case "${key}" in
            ACCOUNTING) REC_ACCOUNTING=${value} ;;
            PORT_BASE) REC_PORT_BASE=${value} ;;
            NODES) REC_NODES=${value} ;;
        esac
    done <"${MODE_FILE}"
}

write_mode() {
    printf 'ACCOUNTING=%s\nPORT_BASE=%s\nNODES=%s\n' "${ACCOUNTING}" "${PORT_BASE}" "${NODES}" >"${MODE_FILE}.tmp"
    mv -f "${MODE_FILE}.tmp" "${MODE_FILE}"
}

# ---------------------------------------------------------------- processes

# running PID [COMM]: PID is a live process (with that command name, if given). PID 1 here reaps
# slowly, so a zombie counts as dead; the name check keeps a recycled PID from passing for ours.
running() {
    local pid=$1 comm=${2:-} stat rest
    [[ "${pid}" =~ ^[0-9]+$ ]] || return 1
    stat=$(cat "/proc/${pid}/stat" 2>/dev/null) || return 1
    [[ -z "${comm}" || "${stat}" == *"(${comm})"* ]] || return 1
    rest=${stat##*) }
    [[ "${rest%% *}" != Z ]]
}

# alive PIDFILE COMM: the daemon's own pidfile names a running process.
alive() {
    local pid=""
    [[ -s "$1" ]] || return 1
    read -r pid <"$1" || true
    running "${pid}" "$2"
}

pid_of() { local pid; read -r pid <"$1"; printf '%s' "${pid}"; }

# wait_until SECONDS CMD...: poll CMD every 0.2 s.
wait_until() {
    local timeout=$1 deadline
    shift
    deadline=$((SECONDS + timeout))
    until "$@"; do
        ((SECONDS < deadline)) || return 1
        sleep 0.2
    done
}

not_alive() { ! alive "$@"; }

# stop PIDFILE COMM: TERM, wait up to 15 s, then KILL. Only ever signals the PID in our own pidfile.
stop() {
    local pidfile=$1 comm=$2 pid
    if alive "${pidfile}" "${comm}"; then
        pid=$(pid_of "${pidfile}")
        say "stopping ${comm} (pid ${pid})"
        kill -TERM "${pid}" 2>/dev/null || true
        if ! wait_until 15 not_alive "${pidfile}" "${comm}"; then
            say "${comm} (pid ${pid}) ignored SIGTERM for 15 s; sending SIGKILL"
            kill -KILL "${pid}" 2>/dev/null || true
            wait_until 5 not_alive "${pidfile}" "${comm}" || say "${comm} (pid ${pid}) is still alive"
        fi
    fi
    rm -f "${pidfile}"
}

port_free() { ! ss -Htln "sport = :$1" | grep -q .; }

# Check every port before starting anything, so a clash leaves nothing half started.
check_ports() {
    local pidfile comm port
    while read -r pidfile comm port; do
        [[ -n "${port}" ]] || continue
        if ! alive "${RUN}/${pidfile}" "${comm}" && ! port_free "${port}"; then
            die "port ${port} (${comm}) is already in use: another dev cluster? choose another --port-base"
        fi
    done <<EOF
slurmctld.pid slurmctld ${CTLD_PORT}
$(for node in $(node_names); do printf 'slurmd.%s.pid slurmd %s\n' "${node}" "$(node_port "${node#n}")"; done)
$(if ((ACCOUNTING)); then printf 'slurmdbd.pid slurmdbd %s\nmariadbd.pid mariadbd %s' "${DBD_PORT}" "${DB_PORT}"; fi)
EOF
}

log_tail() {
    if [[ -f "$1" ]]; then tail -n 20 "$1" | sed 's/^/    /' >&2; fi
}

# start_daemon NAME PIDFILE COMM LOGFILE CMD...: run CMD (in the foreground mode of the daemon, so a
# crash shows at once) in its own session with no inherited stdio (callers reading our pipes see EOF),
# then wait until its own pidfile names it.
start_daemon() {
    local name=$1 pidfile=$2 comm=$3 logfile=$4 pid started_at=${SECONDS}
    shift 4
    if alive "${pidfile}" "${comm}"; then
        return 0
    fi
    rm -f "${pidfile}"
    say "starting ${name}"
    # 9>&- : the daemons must not inherit (and so hold forever) our lock.
    setsid "$@" </dev/null >>"${LOG}/${name// /-}.out" 2>&1 9>&- &
    pid=$!
    until alive "${pidfile}" "${comm}" && [[ "$(pid_of "${pidfile}")" == "${pid}" ]]; do
        if ! running "${pid}" || ((SECONDS > started_at + 20)); then
            say "${name} did not start; last lines of ${logfile}:"
            log_tail "${logfile}"
            log_tail "${LOG}/${name// /-}.out"
            die "${name} failed to start (see ${logfile})"
        fi
        sleep 0.1
    done
}

# ---------------------------------------------------------------- packages

ensure_packages() {
    local wanted=("${PACKAGES_BASE[@]}" "${PACKAGES_TOOLS[@]}") missing=() pkg
    if ((ACCOUNTING)); then wanted+=("${PACKAGES_ACCOUNTING[@]}"); fi
    local installed
    installed=$(dpkg-query -W -f='${Package} ${Status}\n' "${wanted[@]}" 2>/dev/null || true)
    for pkg in "${wanted[@]}"; do
        grep -qx "${pkg} install ok installed" <<<"${installed}" || missing+=("${pkg}")
    done
    ((${#missing[@]})) || return 0
    command -v apt-get >/dev/null || die "missing packages ${missing[*]} and no apt-get to install them"
    say "installing ${missing[*]}"
    DEBIAN_FRONTEND=noninteractive apt-get update -qq >&2 || die "apt-get update failed"
    # A second test session may be installing too: wait for dpkg's lock instead of failing.
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq -o DPkg::Lock::Timeout=300 --no-install-recommends \
        "${missing[@]}" >&2 ||
        die "apt-get install ${missing[*]} failed"
}

# ---------------------------------------------------------------- config files

# write_file PATH MODE: stdin -> PATH, replacing it only when the content changed.
write_file() {
    local path=$1 mode=$2
    cat >"${path}.new"
    chmod "${mode}" "${path}.new"
    if [[ -f "${path}" ]] && cmp -s "${path}" "${path}.new"; then
        rm -f "${path}.new"
    else
        mv -f "${path}.new" "${path}"
        CONFIG_CHANGED=1
    fi
}

write_slurm_conf() {
    local host accounting_lines
    host=$(hostname -s)
    if ((ACCOUNTING)); then
        accounting_lines="AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1
AccountingStoragePort=${DBD_PORT}
# The munge socket for slurmdbd connections is given here, not taken from AuthInfo.
AccountingStoragePass=${MUNGE_SOCK}
AccountingStorageTRES=gres/gpu"
    else
        accounting_lines="AccountingStorageType=accounting_storage/none"
    fi
    write_file "${SLURM_CONF_FILE}" 644 <<EOF
# Generated by fsdpjob dev-cluster (cluster.sh); rewritten on every \`up\`.
ClusterName=${CLUSTER_NAME}
SlurmctldHost=${host}(127.0.0.1)
SlurmctldPort=${CTLD_PORT}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=${MUNGE_SOCK}
CredType=cred/munge
StateSaveLocation=${SPOOL}/ctld
SlurmdSpoolDir=${SPOOL}/d/%n
SlurmctldPidFile=${RUN}/slurmctld.pid
SlurmdPidFile=${RUN}/slurmd.%n.pid
SlurmctldLogFile=${LOG}/slurmctld.log
SlurmdLogFile=${LOG}/slurmd.%n.log
SlurmctldDebug=info
SlurmdDebug=info
MailProg=/bin/true
MpiDefault=none
# No cgroups in containers: track processes by parentage, bind nothing.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
ReturnToService=2
GresTypes=gpu
${accounting_lines}
JobAcctGatherType=jobacct_gather/none
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
SlurmctldParameters=preempt_send_user_signal
JobRequeue=1
KillWait=10
# Finished jobs stay visible to scontrol for 10 minutes.
MinJobAge=600
MaxJobCount=20000
$(for node in $(node_names); do
        printf 'NodeName=%s NodeHostname=%s NodeAddr=127.0.0.1 Port=%s CPUs=4 RealMemory=8192 Gres=gpu:2 State=UNKNOWN\n' \
            "${node}" "${host}" "$(node_port "${node#n}")"
    done)
# A preempted job's grace: its workers' stop checkpoint and the requeue took 3-6 s in CI; 30 s ran out once on
# a machine at load 24, and Slurm then requeued the job itself (tests/slurm/test_sweep_slurm.py).
PartitionName=debug Nodes=n[1-2] Default=YES MaxTime=INFINITE State=UP PriorityTier=1 PreemptMode=REQUEUE GraceTime=60
PartitionName=high Nodes=n[1-2] MaxTime=INFINITE State=UP PriorityTier=10 PreemptMode=OFF
$(if ((NODES > 2)); then
        printf 'PartitionName=wide Nodes=n[1-%d] MaxTime=INFINITE State=UP PriorityTier=1 PreemptMode=REQUEUE GraceTime=60\n' \
            "${NODES}"
    fi)
EOF
    # A GPU without File= is dropped, and File= must be a character device (mknod below).
    write_file "${ETC}/gres.conf" 644 <<EOF
AutoDetect=off
NodeName=n[1-${NODES}] Name=gpu File=${DEV}/gpu[0-1]
EOF
}

write_slurmdbd_conf() {
    local host password
    host=$(hostname -s)
    password=$(cat "${STATE_DIR}/db.pass")
    write_file "${ETC}/slurmdbd.conf" 600 <<EOF
# Generated by fsdpjob dev-cluster (cluster.sh).
AuthType=auth/munge
AuthInfo=socket=${MUNGE_SOCK}
DbdHost=${host}
DbdAddr=127.0.0.1
DbdPort=${DBD_PORT}
SlurmUser=root
PidFile=${RUN}/slurmdbd.pid
LogFile=${LOG}/slurmdbd.log
DebugLevel=info
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=${DB_PORT}
StorageUser=slurm
StoragePass=${password}
StorageLoc=slurm_acct_db
EOF
}

make_layout() {
    mkdir -p "${ETC}" "${RUN}" "${LOG}" "${SPOOL}/ctld" "${DEV}" "${MUNGE_DIR}"
    local node
    for node in $(node_names); do mkdir -p "${SPOOL}/d/${node}"; done
    # munged refuses a socket dir that others cannot traverse.
    chmod 755 "${STATE_DIR}" "${MUNGE_DIR}"
    local i
    for i in 0 1; do
        # Fake GPUs: character devices with /dev/null's numbers.
        [[ -c "${DEV}/gpu${i}" ]] || { rm -f "${DEV}/gpu${i}"; mknod "${DEV}/gpu${i}" c 1 3; }
    done
    if [[ ! -s "${MUNGE_DIR}/munge.key" ]]; then
        dd if=/dev/urandom of="${MUNGE_DIR}/munge.key" bs=1k count=1 status=none
        chmod 400 "${MUNGE_DIR}/munge.key"
    fi
    if ((ACCOUNTING)) && [[ ! -s "${STATE_DIR}/db.pass" ]]; then
        (umask 077 && od -An -N16 -tx1 /dev/urandom | tr -d ' \n' >"${STATE_DIR}/db.pass")
    fi
}

# ---------------------------------------------------------------- daemons

start_munge() {
    alive "${RUN}/munged.pid" munged || clear_stale_munge_socket
    start_daemon munged "${RUN}/munged.pid" munged "${LOG}/munged.log" \
        munged --foreground --socket="${MUNGE_SOCK}" --key-file="${MUNGE_DIR}/munge.key" --log-file="${LOG}/munged.log" \
        --pid-file="${RUN}/munged.pid" --seed-file="${MUNGE_DIR}/munge.seed"
    wait_until 10 munge_works || die "munged runs but credentials do not round-trip (see ${LOG}/munged.log)"
}

# A socket file left by a killed munged makes the next one refuse to start.
clear_stale_munge_socket() { rm -f "${MUNGE_SOCK}" "${MUNGE_SOCK}.lock"; }

munge_works() { munge -S "${MUNGE_SOCK}" -n 2>/dev/null | unmunge -S "${MUNGE_SOCK}" >/dev/null 2>&1; }

mariadb_sql() { mariadb --no-defaults -S "${DB_SOCK}" -u root -e "$1"; }
mariadb_ping() { mariadb-admin --no-defaults -S "${DB_SOCK}" -u root ping >/dev/null 2>&1; }

start_mariadb() {
    if [[ ! -d "${DB_DIR}/mysql" ]]; then
        say "initialising the accounting database"
        mariadb-install-db --no-defaults --datadir="${DB_DIR}" --user=root \
            --auth-root-authentication-method=normal --skip-test-db >>"${LOG}/mariadb-install.log" 2>&1 ||
            { log_tail "${LOG}/mariadb-install.log"; die "mariadb-install-db failed (see ${LOG}/mariadb-install.log)"; }
    fi
    start_daemon mariadbd "${RUN}/mariadbd.pid" mariadbd "${LOG}/mariadbd.log" \
        mariadbd --no-defaults --datadir="${DB_DIR}" --socket="${DB_SOCK}" --port="${DB_PORT}" \
        --bind-address=127.0.0.1 --user=root --pid-file="${RUN}/mariadbd.pid" --log-error="${LOG}/mariadbd.log" \
        --innodb-buffer-pool-size=32M --innodb-log-file-size=48M --innodb-lock-wait-timeout=900 --skip-log-bin
    wait_until 30 mariadb_ping || { log_tail "${LOG}/mariadbd.log"; die "mariadbd does not answer on ${DB_SOCK}"; }
    local password host sql=""
    password=$(cat "${STATE_DIR}/db.pass")
    for host in localhost 127.0.0.1; do
        sql+="CREATE USER IF NOT EXISTS 'slurm'@'${host}' IDENTIFIED BY '${password}';"
        # A database kept from an earlier state (a run killed mid-up, a db.pass lost) holds the user with another
        # password, which CREATE ... IF NOT EXISTS keeps: slurmdbd was then refused ("Access denied for user").
        sql+="ALTER USER 'slurm'@'${host}' IDENTIFIED BY '${password}';"
        sql+="GRANT ALL ON slurm_acct_db.* TO 'slurm'@'${host}';"
    done
    mariadb_sql "${sql}" || die "could not create the slurm database user"
}

sacctmgr_ok() { timeout 10 sacctmgr -n -P show cluster format=cluster >/dev/null 2>&1; }

start_slurmdbd() {
    start_daemon slurmdbd "${RUN}/slurmdbd.pid" slurmdbd "${LOG}/slurmdbd.log" slurmdbd -D
    wait_until 30 sacctmgr_ok || { log_tail "${LOG}/slurmdbd.log"; die "slurmdbd does not answer sacctmgr"; }
    if ! timeout 10 sacctmgr -n -P show cluster format=cluster | grep -qx "${CLUSTER_NAME}"; then
        timeout 20 sacctmgr -i add cluster "${CLUSTER_NAME}" >&2 || die "sacctmgr add cluster ${CLUSTER_NAME} failed"
    fi
}

start_slurmctld() {
    start_daemon slurmctld "${RUN}/slurmctld.pid" slurmctld "${LOG}/slurmctld.log" slurmctld -D -f "${SLURM_CONF_FILE}"
}

start_slurmd() {
    local node=$1
    start_daemon "slurmd ${node}" "${RUN}/slurmd.${node}.pid" slurmd "${LOG}/slurmd.${node}.log" \
        slurmd -D -f "${SLURM_CONF_FILE}" -N "${node}"
}

# Every node answers and is usable; a busy cluster (mix/alloc) counts as ready too.
nodes_ready() {
    timeout 10 sinfo -h -N -o '%N %t' 2>/dev/null |
        awk -v n="${NODES}" '$2 ~ /^(idle|mix|alloc|comp)$/ { ok[$1] = 1 }
            END { for (i = 1; i <= n; i++) if (!ok["n" i]) exit 1; exit 0 }'
}

sacct_ok() { timeout 10 sacct -n -X -S now-1minutes -o JobID >/dev/null 2>&1; }

# ---------------------------------------------------------------- commands

print_export() { printf 'export SLURM_CONF=%s\n' "${SLURM_CONF_FILE}"; }

daemons() {
    # name pidfile comm
    if [[ "${REC_ACCOUNTING:-${ACCOUNTING}}" == 1 ]]; then
        printf '%s %s %s\n' munged munged.pid munged mariadbd mariadbd.pid mariadbd slurmdbd slurmdbd.pid slurmdbd
    else
        printf '%s %s %s\n' munged munged.pid munged
    fi
    printf '%s %s %s\n' slurmctld slurmctld.pid slurmctld
    local node
    for node in $(NODES=${REC_NODES:-${NODES:-${DEFAULT_NODES}}} node_names); do
        printf 'slurmd-%s slurmd.%s.pid slurmd\n' "${node}" "${node}"
    done
}

any_alive() {
    local name pidfile comm
    while read -r name pidfile comm; do
        if alive "${RUN}/${pidfile}" "${comm}"; then return 0; fi
    done < <(daemons)
    return 1
}

check_mode_compatible() {
    read_mode
    [[ -n "${PORT_BASE}" ]] || PORT_BASE=${REC_PORT_BASE:-${DEFAULT_PORT_BASE}}
    [[ -n "${NODES}" ]] || NODES=${REC_NODES:-${DEFAULT_NODES}}
    [[ -n "${REC_ACCOUNTING}" ]] || return 0
    any_alive || return 0
    # A mode file without NODES: started by a cluster.sh of the old port map (slurmd at B+1/B+2, slurmdbd B+3).
    [[ -n "${REC_NODES}" ]] ||
        die "the cluster in ${STATE_DIR} was started by an older fsdpjob (another port map); run 'down' first"
    if [[ "${REC_ACCOUNTING}" != "${ACCOUNTING}" ]]; then
        local was="with accounting" hint="drop --no-accounting"
        [[ "${REC_ACCOUNTING}" == 1 ]] || { was="without accounting"; hint="pass --no-accounting"; }
        die "the cluster in ${STATE_DIR} is running ${was}; run 'down' first, or ${hint}"
    fi
    if [[ "${REC_PORT_BASE}" != "${PORT_BASE}" ]]; then
        die "the cluster in ${STATE_DIR} is running on port base ${REC_PORT_BASE}; run 'down' first, or use that --port-base"
    fi
    if [[ "${REC_NODES:-${DEFAULT_NODES}}" != "${NODES}" ]]; then
        die "the cluster in ${STATE_DIR} is running with ${REC_NODES:-${DEFAULT_NODES}} nodes; run 'down' first, or use that --nodes"
    fi
}

cmd_up() {
    [[ ${EUID} -eq 0 ]] || die "the dev cluster needs root (it runs slurmctld/slurmd with SlurmUser=root)"
    local started=${SECONDS}
    mkdir -p "${STATE_DIR}"
    check_mode_compatible
    set_ports
    check_ports
    ensure_packages
    make_layout
    write_mode
    CONFIG_CHANGED=0
    write_slurm_conf
    if ((ACCOUNTING)); then write_slurmdbd_conf; fi

    # The daemons (and every job step) inherit our working dir; keep them off the caller's.
    cd "${RUN}"
    start_munge
    if ((ACCOUNTING)); then
        start_mariadb
        start_slurmdbd
    fi
    local ctld_was_up=0
    if alive "${RUN}/slurmctld.pid" slurmctld; then ctld_was_up=1; fi
    start_slurmctld
    if ((ctld_was_up && CONFIG_CHANGED)); then
        say "config changed; scontrol reconfigure"
        timeout 20 scontrol reconfigure >&2 || say "scontrol reconfigure failed; run 'down' then 'up'"
    fi
    local node
    for node in $(node_names); do start_slurmd "${node}"; done
    if ! wait_until "${UP_TIMEOUT_S}" nodes_ready; then
        timeout 10 sinfo -N -o '%N %t %G %E' >&2 || true
        log_tail "${LOG}/slurmctld.log"
        die "nodes n1..n${NODES} did not become ready within ${UP_TIMEOUT_S} s (see ${LOG})"
    fi
    if ((ACCOUNTING)) && ! wait_until 30 sacct_ok; then
        die "sacct does not work (see ${LOG}/slurmdbd.log and ${LOG}/slurmctld.log)"
    fi
    local first last mode
    first=$(node_port 1)
    last=$(node_port "${NODES}")
    mode="${NODES} nodes, with accounting, ports ${PORT_BASE}-${last}"
    ((ACCOUNTING)) || mode="${NODES} nodes, without accounting, ports ${PORT_BASE} and ${first}-${last}"
    say "dev cluster up in ${STATE_DIR} (${mode}) after $((SECONDS - started)) s"
    print_export
}

job_ids() { timeout 10 squeue -h -o '%A' 2>/dev/null || true; }
no_jobs() { [[ -z "$(job_ids)" ]]; }

cancel_all_jobs() {
    alive "${RUN}/slurmctld.pid" slurmctld || return 0
    local ids
    ids=$(job_ids)
    [[ -n "${ids}" ]] || return 0
    say "cancelling jobs: $(tr '\n' ' ' <<<"${ids}")"
    # shellcheck disable=SC2086 # one argument per job id
    timeout 10 scancel ${ids} 2>/dev/null || true
    # A job that traps SIGTERM holds its nodes for KillWait (10 s) before SIGKILL.
    wait_until "${DRAIN_TIMEOUT_S}" no_jobs || say "jobs still listed after ${DRAIN_TIMEOUT_S} s: $(job_ids | tr '\n' ' ')"
}

kill_tree() {
    local child
    kill -STOP "$1" 2>/dev/null || true # no new children while we collect them
    for child in $(ps -o pid= --ppid "$1"); do kill_tree "${child}"; done
    kill -KILL "$1" 2>/dev/null || true
}

# A job step that outlived the drain wait keeps running after its slurmd is gone. Ours are the
# slurmstepd processes holding our slurmd log open (each inherits it from its slurmd).
kill_orphan_stepds() {
    local proc pid
    for proc in /proc/[0-9]*; do
        pid=${proc#/proc/}
        running "${pid}" slurmstepd || continue
        if find "${proc}/fd" -lname "${LOG}/slurmd.*" 2>/dev/null | grep -q .; then
            say "killing leftover $(tr '\0' ' ' <"${proc}/cmdline")(pid ${pid}) and its processes"
            kill_tree "${pid}"
        fi
    done
}

cmd_down() {
    if [[ ! -d "${STATE_DIR}" ]]; then
        say "no dev cluster in ${STATE_DIR}"
        return 0
    fi
    read_mode
    cancel_all_jobs
    # slurmd first (in parallel; every pidfile there, whatever the mode file says), then the controller, then
    # what it depends on.
    local pidfile
    for pidfile in "${RUN}"/slurmd.n*.pid; do
        [[ -e "${pidfile}" ]] || continue
        stop "${pidfile}" slurmd &
    done
    wait
    kill_orphan_stepds
    stop "${RUN}/slurmctld.pid" slurmctld
    stop "${RUN}/slurmdbd.pid" slurmdbd
    stop "${RUN}/mariadbd.pid" mariadbd
    stop "${RUN}/munged.pid" munged
    if ((PURGE)); then
        rm -rf -- "${STATE_DIR}"
        say "dev cluster in ${STATE_DIR} stopped and removed"
    else
        say "dev cluster in ${STATE_DIR} stopped (state kept; 'down --purge' removes it)"
    fi
}

cmd_status() {
    if [[ ! -d "${STATE_DIR}" ]]; then
        printf 'cluster: absent\nstate dir: %s\n' "${STATE_DIR}"
        return 0
    fi
    read_mode
    local name pidfile comm running=0 total=0 report=""
    while read -r name pidfile comm; do
        total=$((total + 1))
        if alive "${RUN}/${pidfile}" "${comm}"; then
            running=$((running + 1))
            report+=$(printf '%-10s running (pid %s)' "${name}" "$(pid_of "${RUN}/${pidfile}")")$'\n'
        else
            report+=$(printf '%-10s stopped' "${name}")$'\n'
        fi
    done < <(daemons)
    local state=partial accounting=on
    ((running == total)) && state=up
    ((running == 0)) && state=down
    [[ "${REC_ACCOUNTING}" == 1 ]] || accounting=off
    printf 'cluster: %s\nstate dir: %s\naccounting: %s\nport base: %s\nnodes: %s\n%s' \
        "${state}" "${STATE_DIR}" "${accounting}" "${REC_PORT_BASE:-?}" "${REC_NODES:-${DEFAULT_NODES}}" "${report}"
    if alive "${RUN}/slurmctld.pid" slurmctld; then
        timeout 10 sinfo -N -o '%N %P %t %c %G' || true
        timeout 10 squeue -o '%i %P %j %T %R' || true
    fi
    if [[ "${state}" == up ]]; then print_export; fi
}

# Serialise up/down on one state dir (two test sessions may start at once).
take_lock() {
    mkdir -p "$(dirname -- "${STATE_DIR}")"
    exec 9>"${STATE_DIR}.lock"
    flock -w 300 9 || die "another cluster.sh holds ${STATE_DIR}.lock for 300 s"
}

main() {
    parse_args "$@"
    set_layout
    case "${COMMAND}" in
        up) take_lock; cmd_up ;;
        down) take_lock; cmd_down ;;
        status) cmd_status ;;
        packages) ensure_packages ;;
    esac
}

main "$@"
