#!/usr/bin/env bash
# What travels to a lent device machine is this checkout's working tree: the tracked files and the untracked ones git
# does not ignore, at most 64 MiB a call. The tracked tree holds three ~25 MB drafters (the shipped DFlash drafter,
# the D2SD VP drafter and the CPU campaign's state), more than that. `slim` takes the checkpoints a device run does
# not read out of git's index and ignores them in .git/info/exclude (the files stay on disk; nothing is committed);
# `restore` puts them back. Between the two, commit nothing: a commit would record their removal.
#
#   bash examples/device_slim.sh slim       # then the device calls (examples/gpu_check.sh reads no checkpoint)
#   bash examples/device_slim.sh restore
#   bash examples/device_slim.sh size       # MiB that would travel now
#
# SLIM_PATHS overrides the checkpoints taken out (space-separated, relative to the repository root).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
read -r -a paths <<< "${SLIM_PATHS:-checkpoints/campaign-smollm2 checkpoints/smollm2-135m-instruct-d2sd-vp}"
marker="# examples/device_slim.sh: left out of device runs until 'restore'"
exclude=$(git rev-parse --git-path info/exclude)

travelling_mib() {
    git ls-files -z --cached --others --exclude-standard | xargs -0 -r stat -c %s -- 2>/dev/null \
        | awk '{ total += $1 } END { printf "%.1f\n", total / 1048576 }'
}

case "${1:-}" in
slim)
    if grep -qxF "$marker" "$exclude" 2>/dev/null; then
        echo "already slim ($(travelling_mib) MiB would travel); 'restore' first to slim again" >&2
        exit 1
    fi
    if ! git diff --cached --quiet; then
        echo "the index holds staged changes: commit or unstage them first, so that a commit made while slim cannot" \
             "mix them with the checkpoints' removal" >&2
        exit 1
    fi
    git rm -r -q --cached -- "${paths[@]}"
    mkdir -p "$(dirname "$exclude")"
    { echo "$marker"; for path in "${paths[@]}"; do echo "/$path/"; done; } >> "$exclude"
    echo "slim: $(travelling_mib) MiB would travel (limit 64). Commit nothing until 'bash examples/device_slim.sh restore'."
    ;;
restore)
    git reset -q HEAD -- "${paths[@]}"
    if [ -f "$exclude" ]; then  # drop the marker and the lines after it that slim wrote
        python3 - "$exclude" "$marker" "${paths[@]}" <<'EOF'
import sys
path, marker, *paths = sys.argv[1:]
written = {marker, *(f"/{p}/" for p in paths)}
lines = open(path).read().splitlines()
kept = [line for line in lines if line not in written]
open(path, "w").write("".join(line + "\n" for line in kept))
EOF
    fi
    echo "restored: $(travelling_mib) MiB would travel"
    ;;
size)
    travelling_mib
    ;;
*)
    echo "usage: bash examples/device_slim.sh slim|restore|size" >&2
    exit 2
    ;;
esac
