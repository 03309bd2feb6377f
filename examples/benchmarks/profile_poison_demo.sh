#!/usr/bin/env bash
# Is a verify-cost profile poisoned by a busy machine? Each arm is a fresh `hf-diffspec demo --runs 5` process on a
# quiet machine, after: a quiet first use; the cached quiet profile; a first use while two spinning processes load
# the cores (nothing may be cached); the cached profile with T(1) 5x; with every entry 5x (caught live). Then PAIRS
# interleaved pairs of a quiet profile and the 5x-everywhere one. Run it with nothing else on the machine:
#     bash examples/benchmarks/profile_poison_demo.sh > poison.txt      (PAIRS=2 by default)
set -u
cache="${HF_DIFFSPEC_CACHE:-$HOME/.cache/hf_diffspec}/profiles"
work=$(mktemp -d)
speed() { grep -E "plain generate: |speculative generate: |^Speed: " | sed 's/^ *//' | cut -c1-60 | tr '\n' ' '; }
demo() { hf-diffspec demo --runs 5 2>&1 | tee "$work/last.log" | speed; echo " ($(grep -c 'measuring it again' "$work/last.log") re-measured)"; }
poison() {  # $1: slow_one_token | slow_everywhere; writes the poisoned copy of the quiet profile into the cache
    python - "$1" "$work/quiet.json" "$cache" <<'PY'
import json, sys
kind, quiet, cache = sys.argv[1:]
profile = json.load(open(quiet))
for row in profile["verify_seconds"].values():
    for n in row:
        if kind == "slow_everywhere" or n == "1":
            row[n] *= 5
json.dump(profile, open(f"{cache}/{profile['key']}.json", "w"))
PY
}
echo "load before: $(cat /proc/loadavg)"
hf-diffspec profile --clear > /dev/null
echo "quiet first use: $(demo)"
cp "$cache"/*.json "$work/quiet.json"
echo "quiet cached: $(demo)"
hf-diffspec profile --clear > /dev/null
for i in 1 2; do python -c "while True: pass" & done
sleep 2
hf-diffspec demo --runs 1 --max-new-tokens 16 > /dev/null 2>&1
kill $(jobs -p); sleep 3
echo "after a first use under load, cached: $(hf-diffspec profile --show | tr '\n' ' ')"
echo "quiet after the loaded first use: $(demo)"
for kind in slow_one_token slow_everywhere; do poison $kind; echo "cached $kind: $(demo)"; done
for i in $(seq "${PAIRS:-2}"); do
    cp "$work/quiet.json" "$cache/$(python -c "import json,sys;print(json.load(open(sys.argv[1]))['key'])" "$work/quiet.json").json"
    echo "pair $i quiet: $(demo)"
    poison slow_everywhere
    echo "pair $i 5x everywhere: $(demo)"
done
echo "load after: $(cat /proc/loadavg)"
