#!/usr/bin/env bash
# What travels to a lent device machine is this checkout's working tree: the tracked files and the untracked ones git
# does not ignore, at most 64 MiB a call. The tracked tree holds three ~25 MB drafters (the shipped DFlash drafter,
# the D2SD VP drafter and the CPU campaign's state), more than that. `slim` takes the checkpoints a device run does
# not read out of git's index and ignores them in .git/info/exclude (the files stay on disk; nothing is committed);
# `restore` puts back what `slim` took out. Between the two, commit nothing: a commit would record their removal.
#
#   bash examples/device_slim.sh slim       # then the device calls (examples/gpu_check.sh reads no checkpoint)
#   bash examples/device_slim.sh restore
#   bash examples/device_slim.sh size       # MiB that would travel now
#   bash examples/device_slim.sh wheels [DIR]   # the libraries a GPU image lacks or holds older, as wheels in DIR
#                                               # (default .device-wheels, ignored: carry it; examples/device_env.sh)
#
# SLIM_PATHS overrides the checkpoints taken out (space-separated, relative to the repository root); SLIM_PATHS=all
# takes out every checkpoint (the drafter campaign's lease carries the shipped drafter itself:
# examples/drafter_campaign.sh).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
slim_paths=${SLIM_PATHS:-checkpoints/campaign-smollm2 checkpoints/smollm2-135m-instruct-d2sd-vp}
[ "$slim_paths" = all ] && slim_paths=$(git ls-files checkpoints | cut -d/ -f1-2 | sort -u | tr '\n' ' ')
read -r -a paths <<< "$slim_paths"
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
    # the paths slim wrote after its marker, whatever SLIM_PATHS says now; the marker and those lines go
    mapfile -t paths < <(python3 - "$exclude" "$marker" <<'EOF'
import sys
from itertools import takewhile
from pathlib import Path
path, marker = Path(sys.argv[1]), sys.argv[2]
lines = path.read_text().splitlines() if path.exists() else []
if marker in lines:
    at = lines.index(marker)
    taken = list(takewhile(lambda line: line.startswith("/checkpoints/"), lines[at + 1:]))
    print("\n".join(line.strip("/") for line in taken))
    path.write_text("".join(line + "\n" for line in lines[:at] + lines[at + 1 + len(taken):]))
EOF
    )
    [ "${#paths[@]}" -gt 0 ] && git reset -q HEAD -- "${paths[@]}"
    echo "restored: $(travelling_mib) MiB would travel"
    ;;
size)
    travelling_mib
    ;;
wheels)
    # what the image lacks (gguf, z-lab's dflash) or holds older (transformers, peft), ~14 MiB: gguf, dflash and peft
    # as installed here;
    # transformers 5.24, the newest that takes the image's huggingface_hub 1.x (5.25 needs hub >= 2.4, which needs
    # httpx2, absent there)
    dir=${2:-.device-wheels}
    mkdir -p "$dir"
    pins="transformers==${DEVICE_TRANSFORMERS:-5.24.0} $(python -m pip freeze | grep -i -E '^(gguf|peft|dflash)==')"
    python -m pip download -q --no-deps --only-binary=:all: -d "$dir" $pins
    du -sh "$dir"
    ;;
*)
    echo "usage: bash examples/device_slim.sh slim|restore|size|wheels [DIR]" >&2
    exit 2
    ;;
esac
