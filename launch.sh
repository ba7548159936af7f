#!/usr/bin/env bash
# Launch toolkit/train.py under the DeepSpeed launcher with a ZeRO preset.
#
# Arguments travel in arrays and are never eval'ed: whatever you pass after `--` reaches
# train.py byte for byte. Run `./launch.sh --help` for the interface.
set -euo pipefail

SCRIPT_DIR=$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" && pwd -P)
REPO=$SCRIPT_DIR
PYTHON=${PYTHON:-python3}

usage() {
    cat <<'EOF'
usage: ./launch.sh --stage {0,1,2,3} [--offload none|optimizer|all|nvme] | --plan DIR
                   [--gpus N | --include SPEC] [--hostfile FILE] [--launcher pdsh|openmpi|slurm]
                   [--no-ssh --node-rank R --master-addr A [--master-port P]]
                   [--config x.yaml] [--path trainer|raw] [--dry-run] [-- key=value ...]

  --stage S          ZeRO stage (required, unless --plan)
  --plan DIR         run what `toolkit plan ... -o DIR` chose: DIR/ds_config.json, DIR/train.yaml
                     (micro-batch, checkpointing, ...) and its GPUs per node unless --gpus/--include/--hostfile
  --offload O        none (default); optimizer: optimizer state to CPU (stage 1-3);
                     all: optimizer + parameters to CPU (stage 3); nvme: both to NVMe (stage 3)
  --gpus N           ranks per host (DeepSpeed --num_gpus); default: every visible GPU,
                     or 2 CPU ranks (DS_ACCELERATOR=cpu) when there is no GPU
  --include SPEC     DeepSpeed --include, e.g. worker-1:0,1@worker-2
  --hostfile FILE    `host slots=N` lines (see hostfile.example); strictly validated
  --launcher L       multi-node backend: pdsh (DeepSpeed's default), openmpi, slurm
                     (slurm: hosts from SLURM_JOB_NODELIST, slots from SLURM_GPUS_ON_NODE or --gpus)
  --no-ssh           start this node only; run once per node with its --node-rank
  --node-rank R      this node's index in the hostfile (with --no-ssh)
  --master-addr A    address of node 0 (required with --no-ssh)
  --master-port P    default 29500
  --config FILE      training YAML for train.py
  --path P           trainer (HF Trainer, default) or raw (deepspeed.initialize loop)
  --dry-run          print the config file, world size and command; run nothing
  -- key=value ...   overrides for train.py, e.g. -- train.max_steps=5 train.run_dir=runs/x
EOF
}

die_usage() {
    printf 'launch.sh: error: %s\n' "$1" >&2
    usage >&2
    exit 2
}

die() {
    printf 'launch.sh: error: %s\n' "$1" >&2
    exit 1
}

is_uint() { [[ $1 =~ ^[0-9]+$ ]]; }

# ---- arguments -------------------------------------------------------------------------------
stage="" offload="none" gpus="" include="" hostfile="" launcher="" no_ssh=0
node_rank="" master_addr="" master_port="" config="" train_path="trainer" dry_run=0 plan_dir=""
overrides=()

while (($#)); do
    opt=$1
    inline=0
    if [[ $opt == --*=* ]]; then # --stage=3 form
        value=${opt#*=}
        opt=${opt%%=*}
        inline=1
    fi
    case $opt in
    -h | --help)
        usage
        exit 0
        ;;
    --dry-run | --no-ssh)
        ((inline == 0)) || die_usage "$opt takes no value"
        if [[ $opt == --dry-run ]]; then dry_run=1; else no_ssh=1; fi
        shift
        continue
        ;;
    --)
        shift
        overrides=("$@")
        break
        ;;
    --stage | --offload | --gpus | --include | --hostfile | --launcher | --node-rank | --master-addr | \
        --master-port | --config | --path | --plan)
        if ((inline == 0)); then
            (($# >= 2)) || die_usage "$opt needs a value"
            value=$2
            shift 2
        else
            shift
        fi
        [[ -n $value && $value != --* ]] || die_usage "$opt needs a value (got '${value}')"
        ;;
    *)
        die_usage "unknown argument '$1' (training overrides go after --, e.g. -- train.max_steps=5)"
        ;;
    esac
    case $opt in
    --stage) stage=$value ;;
    --offload) offload=$value ;;
    --gpus) gpus=$value ;;
    --include) include=$value ;;
    --hostfile) hostfile=$value ;;
    --launcher) launcher=$value ;;
    --node-rank) node_rank=$value ;;
    --master-addr) master_addr=$value ;;
    --master-port) master_port=$value ;;
    --config) config=$value ;;
    --path) train_path=$value ;;
    --plan) plan_dir=${value%/} ;;
    esac
done

if [[ -n $plan_dir ]]; then
    # The plan fixes the stage, offload and training config; a launch flag would silently disagree.
    [[ -z $stage && $offload == none && -z $config ]] ||
        die_usage "--plan DIR sets the stage, offload and training config; drop --stage/--offload/--config"
    for f in plan.json ds_config.json train.yaml; do
        [[ -f $plan_dir/$f ]] || die "--plan: no $plan_dir/$f (write it with: toolkit plan ... -o $plan_dir)"
    done
    plan_vals=$("$PYTHON" -c 'import json, sys
d = json.load(open(sys.argv[1]))
c, i = d["chosen"], d["inputs"]
print(c["stage"], c["offload"], i["gpus_per_node"])' "$plan_dir/plan.json") || die "--plan: cannot read $plan_dir/plan.json"
    read -r stage offload plan_gpus <<<"$plan_vals"
    config="$plan_dir/train.yaml"
    overrides=("train.plan=$plan_dir/plan.json" ${overrides[@]+"${overrides[@]}"})
    [[ -n $gpus || -n $include || -n $hostfile || $launcher == slurm ]] || gpus=$plan_gpus
fi

[[ -n $stage ]] || die_usage "--stage is required"
[[ $stage =~ ^[0-3]$ ]] || die_usage "--stage must be 0, 1, 2 or 3 (got '$stage')"
case $offload in none | optimizer | all | nvme) ;; *) die_usage "--offload must be none, optimizer, all or nvme (got '$offload')" ;; esac
case $train_path in trainer | raw) ;; *) die_usage "--path must be trainer or raw (got '$train_path')" ;; esac
case $launcher in "" | pdsh | openmpi | slurm) ;; *) die_usage "--launcher must be pdsh, openmpi or slurm (got '$launcher')" ;; esac
if [[ -n $gpus ]]; then
    if ! { is_uint "$gpus" && ((10#$gpus >= 1)); }; then
        die_usage "--gpus must be a positive integer (got '$gpus')"
    fi
    gpus=$((10#$gpus))
fi
[[ -z $gpus || -z $include ]] || die_usage "--gpus and --include cannot be combined (DeepSpeed refuses it)"
if ((no_ssh)); then
    [[ -n $node_rank ]] || die_usage "--no-ssh needs --node-rank R"
    [[ -n $master_addr ]] || die_usage "--no-ssh needs --master-addr (DeepSpeed would try ssh to find it)"
    [[ -n $hostfile ]] || die_usage "--no-ssh needs --hostfile (every node must see the same host list)"
    [[ -z $launcher ]] || die_usage "--no-ssh starts one node locally; it does not take --launcher"
    is_uint "$node_rank" || die_usage "--node-rank must be a non-negative integer (got '$node_rank')"
elif [[ -n $node_rank ]]; then
    die_usage "--node-rank only makes sense with --no-ssh"
fi
# DeepSpeed puts the address into the remote shell's command line (pdsh) and mpirun's arguments.
if [[ -n $master_addr && ! $master_addr =~ ^[A-Za-z0-9][A-Za-z0-9._:-]*$ ]]; then
    die_usage "--master-addr must be a host name or an IP address (got '$master_addr')"
fi
if [[ -n $master_port ]]; then
    if ! { is_uint "$master_port" && ((10#$master_port >= 1 && 10#$master_port <= 65535)); }; then
        die_usage "--master-port must be 1-65535 (got '$master_port')"
    fi
fi
[[ $launcher != slurm || -z $hostfile ]] || die_usage "--launcher slurm builds the hostfile from SLURM_JOB_NODELIST; drop --hostfile"
# DeepSpeed's OpenMPI runner starts every slot of the hostfile and raises on a narrower launch.
[[ $launcher != openmpi || (-z $gpus && -z $include) ]] || die_usage "--launcher openmpi starts every slot of the hostfile; drop --gpus/--include and edit the hostfile"
[[ -z $config || -f $config ]] || die "--config: no such file: $config"
[[ -f $REPO/toolkit/__init__.py ]] || die "cannot find the toolkit package next to launch.sh ($REPO)"
command -v "$PYTHON" >/dev/null || die "python not found ($PYTHON); set PYTHON=/path/to/python"

# The toolkit package must import from the checkout (uninstalled, and on remote nodes:
# DeepSpeed's multi-node runners forward PYTHON* variables).
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
tk() { "$PYTHON" -m toolkit.launch.hostfile "$@"; }

# ---- which DeepSpeed config ---------------------------------------------------------------------
gen_args=(--stage "$stage")
case $offload in
none) name="zero$stage" ;;
optimizer)
    ((stage >= 1)) || die_usage "--offload optimizer needs stage 1, 2 or 3 (ZeRO-0 has no optimizer partitioning)"
    if ((stage == 3)); then name="zero3_offload_optimizer"; else name="zero${stage}_offload"; fi
    gen_args+=(--offload-optimizer cpu)
    ;;
all)
    ((stage == 3)) || die_usage "--offload all (optimizer + parameters) needs --stage 3; for stage $stage use --offload optimizer"
    name="zero3_offload"
    gen_args+=(--offload-optimizer cpu --offload-param cpu)
    ;;
nvme)
    ((stage == 3)) || die_usage "--offload nvme needs --stage 3"
    name="zero3_offload_nvme"
    gen_args+=(--offload-optimizer nvme --offload-param nvme)
    ;;
esac
ds_file="$REPO/ds_configs/$name.json"
need_gen=0
[[ -f $ds_file ]] || need_gen=1
if [[ -n $plan_dir ]]; then
    ds_file="$plan_dir/ds_config.json" # the preset above only validated the stage/offload pair
    need_gen=0
fi

# ---- hosts and world size -----------------------------------------------------------------------
cleanup_files=()
cleanup() { ((${#cleanup_files[@]} == 0)) || rm -f -- "${cleanup_files[@]}"; }
trap cleanup EXIT

detect_gpus() {
    # nvidia-smi counts without loading torch; CUDA_VISIBLE_DEVICES narrows what DeepSpeed sees.
    local n=0 visible
    if [[ ${DS_ACCELERATOR:-} == cpu ]]; then
        echo 0
        return
    fi
    if command -v nvidia-smi >/dev/null 2>&1; then
        n=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)
    elif [[ -e /dev/nvidia0 || -d /proc/driver/nvidia ]]; then
        n=$("$PYTHON" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
    fi
    if [[ -n ${CUDA_VISIBLE_DEVICES+set} && $n -gt 0 ]]; then
        visible=${CUDA_VISIBLE_DEVICES// /}
        if [[ -z $visible || $visible == -1 ]]; then
            n=0
        else
            local -a ids
            IFS=, read -r -a ids <<<"$visible"
            ((${#ids[@]} < n)) && n=${#ids[@]}
        fi
    fi
    echo "$n"
}

ngpu=$(detect_gpus)
cpu_mode=0
# CPU mode only where this node is the one that trains: a pdsh/openmpi launch from a login node
# without GPUs must not force DS_ACCELERATOR=cpu onto GPU workers.
if ((ngpu == 0)) && [[ -z $hostfile || $no_ssh == 1 || $launcher == slurm || ${DS_ACCELERATOR:-} == cpu ]]; then
    cpu_mode=1
    export DS_ACCELERATOR=cpu
fi

if [[ $launcher == slurm ]]; then
    [[ -n ${SLURM_JOB_NODELIST:-} ]] || die "--launcher slurm: SLURM_JOB_NODELIST is not set (run inside salloc/sbatch)"
    hostfile=$(mktemp "${TMPDIR:-/tmp}/launch-hostfile.XXXXXX")
    cleanup_files+=("$hostfile")
    slot_args=()
    if [[ -n $gpus ]]; then
        slot_args=(--slots "$gpus")
    elif [[ -z ${SLURM_GPUS_ON_NODE:-}${SLURM_GPUS_PER_NODE:-} ]]; then
        # Allocation without --gpus-per-node: assume nodes like this one.
        if ((ngpu > 0)); then slot_args=(--slots "$ngpu"); else slot_args=(--slots 2); fi
    fi
    tk slurm-hostfile -o "$hostfile" "${slot_args[@]}" || exit 1
    gpus="" # folded into the hostfile's slots
fi

inc_args=()
[[ -n $include ]] && inc_args=(--include "$include")
gpu_args=()
[[ -n $gpus ]] && gpu_args=(--num-gpus "$gpus")
nhosts=1
if [[ -n $hostfile ]]; then
    hosts_text=$(tk hosts --hostfile "$hostfile" "${inc_args[@]}") || exit 1
    mapfile -t active_hosts <<<"$hosts_text"
    nhosts=${#active_hosts[@]}
    world=$(tk world-size --hostfile "$hostfile" "${inc_args[@]}" "${gpu_args[@]}") || exit 1
    if ((no_ssh)); then
        all_text=$(tk hosts --hostfile "$hostfile") || exit 1
        mapfile -t all_hosts <<<"$all_text"
        ((10#$node_rank < ${#all_hosts[@]})) ||
            die "--node-rank $node_rank is out of range: $hostfile has ${#all_hosts[@]} host(s) (ranks 0-$((${#all_hosts[@]} - 1)))"
    fi
    if [[ $launcher == slurm && -z $master_addr ]]; then
        master_addr=${active_hosts[0]} # else DeepSpeed asks `ssh host hostname -I`
    fi
elif [[ -n $gpus ]]; then
    ((cpu_mode || gpus <= ngpu)) || die "--gpus $gpus but only $ngpu GPU(s) are visible here"
    world=$gpus
elif [[ -n $include ]]; then
    local_slots=$ngpu
    ((cpu_mode)) && local_slots=2
    world=$(tk world-size --local-slots "$local_slots" --include "$include") || exit 1
elif ((cpu_mode)); then
    gpus=2 # DeepSpeed's CPU accelerator counts NUMA nodes; ask for 2 ranks explicitly
    world=2
else
    world=$ngpu
fi
multi_node=0
((nhosts > 1 && !no_ssh)) && multi_node=1

# ---- the command ----------------------------------------------------------------------------------
# Across hosts DeepSpeed starts its own sys.executable on every node: running the runner under
# $PYTHON makes that the interpreter the pre-flight below has checked on every host.
if ((multi_node == 0)) && command -v deepspeed >/dev/null 2>&1; then
    cmd=(deepspeed)
else
    cmd=("$PYTHON" -m deepspeed.launcher.runner)
fi
[[ -n $hostfile ]] && cmd+=(--hostfile "$hostfile")
[[ -n $include ]] && cmd+=(--include "$include")
[[ -n $gpus ]] && cmd+=(--num_gpus "$gpus")
[[ -n $launcher ]] && cmd+=(--launcher "$launcher")
# srun starts the ranks; ssh between Slurm nodes is often not allowed at all.
[[ $launcher == slurm ]] && cmd+=(--no_ssh_check)
((no_ssh)) && cmd+=(--no_ssh --node_rank "$((10#$node_rank))")
[[ -n $master_addr ]] && cmd+=(--master_addr "$master_addr")
[[ -n $master_port ]] && cmd+=(--master_port "$((10#$master_port))")
((no_ssh)) && [[ -z $master_port ]] && cmd+=(--master_port 29500)
train_args=(--ds "$ds_file")
[[ -n $config ]] && train_args+=(--config "$config")
train_args+=("train.path=$train_path")
((${#overrides[@]})) && train_args+=("${overrides[@]}")
script=("$REPO/toolkit/train.py" "${train_args[@]}")

if ((multi_node)) && [[ ${launcher:-pdsh} == pdsh ]]; then
    # pdsh hands DeepSpeed's command line to a remote shell as one string (runner.py only
    # double-quotes arguments with spaces), so `$(...)`, `;` or quotes would run there.
    # Refuse rather than let an argument execute on every node.
    for arg in "${train_args[@]}" "$PWD"; do
        [[ $arg =~ ^[A-Za-z0-9_@%+=:,./-]*$ ]] ||
            die "with pdsh, DeepSpeed passes arguments through a remote shell; '$arg' contains shell characters or spaces. Use --launcher openmpi or --no-ssh, or a plainer value"
    done
fi

check_cmd=("$PYTHON" -m toolkit check "$ds_file" --world-size "$world" --path "$train_path")
gen_cmd=("$PYTHON" -m toolkit gen-config "${gen_args[@]}" -o "$ds_file")
# Multi-node over ssh: every host probed before anything starts (toolkit/launch/preflight.py).
preflight_cmd=("$PYTHON" -m toolkit.launch.preflight --hostfile "$hostfile" --launcher "${launcher:-pdsh}")
[[ -n $include ]] && preflight_cmd+=(--include "$include")
[[ -n $gpus ]] && preflight_cmd+=(--num-gpus "$gpus")
[[ -n $master_addr ]] && preflight_cmd+=(--master-addr "$master_addr")
[[ -n $master_port ]] && preflight_cmd+=(--master-port "$((10#$master_port))")
ssh_launch=0
((multi_node)) && [[ $launcher != slurm ]] && ssh_launch=1

quote() {
    local s
    s=$(printf '%q ' "$@")
    printf '%s' "${s% }"
}

mode="GPU"
((cpu_mode)) && mode="CPU (no GPU found: DS_ACCELERATOR=cpu)"
((cpu_mode == 0 && ngpu == 0)) && mode="remote (no GPU on this node; the hosts' accelerators decide)"
echo "config: $ds_file"
echo "world size: $world"
echo "mode: $mode, hosts: $nhosts"

if ((dry_run)); then
    ((need_gen)) && echo "would generate: $(quote "${gen_cmd[@]}")"
    echo "would check: $(quote "${check_cmd[@]}")"
    ((ssh_launch)) && echo "would check hosts: $(quote "${preflight_cmd[@]}")"
    ((multi_node)) && echo "would write: ${DS_ENV_FILE:-.deepspeed_env} (allow-listed variables, see toolkit/launch/hostfile.py)"
    ((cpu_mode)) && echo "env: DS_ACCELERATOR=cpu"
    echo "command: $(quote "${cmd[@]}" "${script[@]}")"
    exit 0
fi

if ((need_gen)); then
    echo "generating $ds_file"
    "${gen_cmd[@]}" || die "could not generate $ds_file"
fi
if ! "${check_cmd[@]}"; then
    die "toolkit check rejected $ds_file for world size $world (see above)"
fi
if ((ssh_launch)); then
    # One line per problem and exit 1 before any rank starts; on success the address of the
    # master (the first host as this node reaches it) and the interface every host reaches it by.
    echo "checking hosts: $(quote "${preflight_cmd[@]}")"
    pf_out=$("${preflight_cmd[@]}") || exit 1
    pf_master="" pf_iface=""
    while IFS='=' read -r key value; do
        case $key in
        master_addr) pf_master=$value ;;
        interface) pf_iface=$value ;;
        esac
    done <<<"$pf_out"
    if [[ -z $master_addr && -n $pf_master ]]; then
        master_addr=$pf_master # else DeepSpeed takes the first word of `ssh host hostname -I`
        cmd+=(--master_addr "$master_addr")
    fi
    if ((cpu_mode)) && [[ -z ${GLOO_SOCKET_IFNAME:-} && -n $pf_iface ]]; then
        # gloo binds what the hostname resolves to (often 127.0.1.1) unless told otherwise.
        export GLOO_SOCKET_IFNAME=$pf_iface
        echo "env: GLOO_SOCKET_IFNAME=$pf_iface (every host reaches the master $master_addr through it)"
    fi
    if [[ $launcher == openmpi ]]; then
        # DeepSpeed's OpenMPI runner passes neither address nor port to the ranks (it expects
        # mpi4py to find them) and pins btl_tcp_if_include to eth0: give both explicitly.
        mpi_args=(-x "MASTER_ADDR=$master_addr" -x "MASTER_PORT=$((10#${master_port:-29500}))")
        [[ -n $pf_iface ]] && mpi_args=(--mca btl_tcp_if_include "$pf_iface" "${mpi_args[@]}")
        cmd+=(--launcher_args "${mpi_args[*]}")
    fi
fi
if ((multi_node)); then
    # DeepSpeed forwards this file's variables to every node (multi-node backends only).
    tk write-env --launcher "${launcher:-pdsh}" || exit 1
fi
if ((ssh_launch)) && [[ ${launcher:-pdsh} == pdsh ]]; then
    # pdsh returns when its ssh to every host has: a host whose network is gone sends no reset, and ssh
    # would wait on it forever (the ranks there end on their own: toolkit/runtime/faults/watchdog.py). With these
    # options ssh gives up on a host that has not answered for 20 s.
    export PDSH_SSH_ARGS_APPEND="${PDSH_SSH_ARGS_APPEND:+$PDSH_SSH_ARGS_APPEND }-o ServerAliveInterval=5 -o ServerAliveCountMax=4"
fi
echo "command: $(quote "${cmd[@]}" "${script[@]}")"
"${cmd[@]}" "${script[@]}"
