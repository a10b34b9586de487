#!/usr/bin/env bash
# kvqbench on Slurm: the N shards of one run as a job array, then a merge job that waits for all of them.
#
# Usage (from the repository root, on a login node, with kvqbench installed in .venv):
#
#   bash scripts/slurm_array.sh N [kvqbench run arguments …]
#
#   e.g. KVQ_SBATCH_ARGS="--gres=gpu:1 --cpus-per-task=4 --mem=64G --time=04:00:00" \
#        bash scripts/slurm_array.sh 8 --full --device cuda --kvq-model Qwen/Qwen3-4B --kvq-dtype bfloat16
#
# It submits
#   1. an array job of N tasks: task I runs
#        kvqbench run --shard I/N ARGS --kvq-out $KVQ_OUT/shards/shard-I-of-N
#      (the shards are duration-balanced and the same on every node; see --kvq-shard);
#   2. a merge job, after every array task has ended (afterany: a failed shard still gets merged and the
#      merged result is stamped incomplete, listing the missing cells):
#        kvqbench merge $KVQ_OUT/shards/shard-*-of-N --out $KVQ_OUT
# and prints both job ids. Logs go to $KVQ_OUT/slurm/.
#
# Environment:
#   KVQ_OUT                results folder (default results)
#   KVQ_SBATCH_ARGS        extra sbatch options of each shard task (GPUs, memory, time, partition …)
#   KVQ_MERGE_SBATCH_ARGS  extra sbatch options of the merge job (it needs no GPU and no torch)
#   KVQ_ARRAY_LIMIT        at most this many shards at once (sbatch --array=1-N%LIMIT)
#   KVQ_VENV               virtual environment to activate in the jobs (default .venv; skipped if absent)
#   KVQ_CAPTURE_CACHE      capture cache shared by the shards of a node (default: the node's $TMPDIR)
#
# Every node needs this checkout at the same path (a shared file system) and the same environment.
# The script calls itself inside the jobs (modes __shard and __merge); call it only as shown above.
set -euo pipefail

usage() {  # the comment block above
    awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"
}

activate() {
    local venv="${KVQ_VENV:-.venv}"
    if [ -f "$venv/bin/activate" ]; then
        # shellcheck disable=SC1091
        . "$venv/bin/activate"
    fi
}

mode="${1:-}"
case "$mode" in
    __shard)
        shift
        n="$1"
        shift
        i="${SLURM_ARRAY_TASK_ID:?__shard runs inside a Slurm array task}"
        out="${KVQ_OUT:-results}"
        activate
        # the user's own cache folder on the node (kvqbench refuses one another user could write)
        cache="${KVQ_CAPTURE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kvqbench/capture}"
        echo "kvqbench slurm: shard $i/$n on $(hostname)"
        # pytest's exit code 5 = the shard got no cell (more shards than cells): not a failure
        rc=0
        kvqbench run --shard "$i/$n" "$@" --kvq-capture-cache "$cache" --kvq-out "$out/shards/shard-$i-of-$n" || rc=$?
        if [ "$rc" -eq 5 ]; then rc=0; fi
        exit "$rc"
        ;;
    __merge)
        shift
        n="$1"
        out="${KVQ_OUT:-results}"
        activate
        shopt -s nullglob
        dirs=("$out"/shards/shard-*-of-"$n")
        if [ "${#dirs[@]}" -eq 0 ]; then
            echo "kvqbench slurm: no shard folder in $out/shards/ (every shard failed before writing)" >&2
            exit 2
        fi
        exec kvqbench merge "${dirs[@]}" --out "$out"
        ;;
    "" | -h | --help)
        usage
        exit 0
        ;;
esac

n="$1"
shift
if ! [[ "$n" =~ ^[1-9][0-9]*$ ]]; then
    echo "slurm_array.sh: the first argument is the number of shards N (a positive integer); got '$n' (see --help)" >&2
    exit 2
fi
if ! command -v sbatch > /dev/null; then
    echo "slurm_array.sh: sbatch not found: run this on a Slurm login node" >&2
    exit 2
fi
out="${KVQ_OUT:-results}"
mkdir -p "$out/slurm"
rm -rf "$out/shards"/shard-*-of-"$n"  # never merge an older run's shard
array="1-$n${KVQ_ARRAY_LIMIT:+%$KVQ_ARRAY_LIMIT}"
# shellcheck disable=SC2086  # KVQ_SBATCH_ARGS is a list of options
shards=$(sbatch --parsable --job-name=kvqbench-shard --array="$array" --output="$out/slurm/shard-%a.log" \
    --export=ALL ${KVQ_SBATCH_ARGS:-} "$0" __shard "$n" "$@")
shards="${shards%%;*}"
# shellcheck disable=SC2086
merge=$(sbatch --parsable --job-name=kvqbench-merge --dependency="afterany:$shards" \
    --output="$out/slurm/merge.log" --export=ALL ${KVQ_MERGE_SBATCH_ARGS:-} "$0" __merge "$n")
merge="${merge%%;*}"
echo "kvqbench slurm: shards job $shards (array $array), merge job $merge -> $out (logs in $out/slurm/)"
