#!/usr/bin/env bash
# Mutation testing of the runtime with mutmut (in the dev extras): one module at a time, against the tests that
# exercise it, in a copy of the repository under runs/mutation/MODULE, at nice 19. Resumable: run it again and
# mutmut goes on where it stopped; `mutmut results` in that folder lists the survivors.
#
#   bash examples/mutation_testing.sh verification            # hf_diffspec/runtime/verification.py
#   bash examples/mutation_testing.sh batch drafting tree     # several, one after another
#   MUTMUT_MAX_CHILDREN=1 bash examples/mutation_testing.sh control_state
#
# Each run leaves runs/mutation/MODULE/summary.txt (mutants: killed, survived, timeouts ...) and survivors.txt
# (each surviving mutant's diff), the input of the triage table in docs/results.md.
#
# The verdicts so far are kept in the repository (docs/mutation/MODULE.json: each mutant's exit code, each function's
# hash), so that a run on another machine goes on where the last one stopped: a new copy starts from them, and mutmut
# runs again only the mutants of functions whose code changed since. A finished run writes them back;
#   bash examples/mutation_testing.sh --save MODULE...
# writes back a run in progress (mutmut records each verdict as it comes).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
[ $# -gt 0 ] || { echo "usage: $0 MODULE... (a file of hf_diffspec/runtime/, without .py)" >&2; exit 2; }

# the tests that exercise each module, quick enough to run once per mutant (mutmut then runs, for each mutant, only
# those of them that reached the mutated function)
tests_for() {
    case "$1" in
        verification) echo "tests/test_sampling_exactness.py tests/test_batch_semantics.py tests/test_decoding.py tests/test_length_gated_processors.py tests/test_batched.py" ;;
        # batch: also the families' tests (sliding-window targets read `next_slots`) and the hybrids' (recurrent
        # states follow the accepted paths)
        batch) echo "tests/test_sampling_exactness.py tests/test_batch_semantics.py tests/test_decoding.py tests/test_length_gated_processors.py tests/test_batched.py tests/test_target_families.py tests/test_hybrid_targets.py" ;;
        # drafting: also the drafting-ahead tests (ahead is off on a CPU by default) and the read budgets; drafting.py
        # also the static drafting pass's (its context is cropped on the device only there)
        drafting) echo "tests/test_trees.py tests/test_d2sd.py tests/test_prompt_lookup.py tests/test_sampling_exactness.py tests/test_decoding.py tests/test_selector.py tests/test_draft_ahead.py tests/test_sync_budget.py tests/test_static_drafting.py tests/test_static_verify.py" ;;
        drafting_best_first|drafting_prefix_tree|drafting_lookup|tree) echo "tests/test_trees.py tests/test_d2sd.py tests/test_prompt_lookup.py tests/test_sampling_exactness.py tests/test_decoding.py tests/test_selector.py tests/test_draft_ahead.py tests/test_sync_budget.py" ;;
        # drafting_static: the static drafting pass runs only with cache_implementation="static"
        drafting_static) echo "tests/test_static_drafting.py tests/test_static_verify.py tests/test_draft_ahead.py" ;;
        verify_attention|verify_inputs|verify_cache|verify_graphs) echo "tests/test_verify_attention.py tests/test_static_verify.py tests/test_target_families.py tests/test_concurrency.py" ;;
        verify_recurrent) echo "tests/test_hybrid_targets.py" ;;
        control_state) echo "tests/test_speculation_state.py tests/test_cost_model.py tests/test_concurrency.py" ;;
        *) echo "no test selection for module $1: add one to tests_for in $0" >&2; exit 2 ;;
    esac
}

# the record of a copy's verdicts in the repository: mutmut's meta file without its timings, or back
record() {  # record save|seed MODULE
    "$ROOT/.venv/bin/python" - "$1" "$ROOT/runs/mutation/$2/mutants/hf_diffspec/runtime/$2.py.meta" \
        "$ROOT/docs/mutation/$2.json" <<'PY'
import json, os, sys
mode, meta, kept = sys.argv[1:]
if mode == "save":
    with open(meta) as f:
        data = json.load(f)
    data = {"exit_code_by_key": {k: v for k, v in data["exit_code_by_key"].items() if v is not None},
            "hash_by_function_name": data["hash_by_function_name"]}
    os.makedirs(os.path.dirname(kept), exist_ok=True)
    with open(kept + ".partial", "w") as f:
        json.dump(data, f, indent=0, sort_keys=True)
    os.replace(kept + ".partial", kept)
elif os.path.exists(kept) and not os.path.exists(meta):
    with open(kept) as f:
        data = json.load(f)
    os.makedirs(os.path.dirname(meta), exist_ok=True)
    with open(meta, "w") as f:
        json.dump({**data, "durations_by_key": {}, "estimated_durations_by_key": {}}, f)
PY
}

if [ "$1" = "--save" ]; then
    shift
    for module in "$@"; do record save "$module"; echo "kept $module's verdicts in docs/mutation/$module.json"; done
    exit 0
fi

PYVENV="$ROOT/.venv"
for module in "$@"; do
    source_file="hf_diffspec/runtime/$module.py"
    [ -f "$source_file" ] || { echo "no $source_file" >&2; exit 2; }
    work="$ROOT/runs/mutation/$module"
    if [ ! -d "$work/hf_diffspec" ]; then
        mkdir -p "$work"
        git archive HEAD hf_diffspec modeling trainers tests checkpoints examples data pyproject.toml | tar -x -C "$work"
        # mutmut imports the copy it mutates from its own folder: the package gets its subpackages as real folders
        # (not the editable install's package-dir mapping) ...
        cp -r "$work/modeling" "$work/hf_diffspec/modeling"
        cp -r "$work/trainers" "$work/hf_diffspec/trainers"
        # ... and a venv that sees the project's packages but not its editable install (whose import hook would
        # load the unmutated package from $ROOT)
        python3 -m venv --without-pip "$work/venv"
        site=$("$work/venv/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
        "$PYVENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])" > "$site/project-venv.pth"
        selection=$(tests_for "$module" | sed 's/\([^ ]*\)/"\1"/g; s/ /, /g')
        cat >> "$work/pyproject.toml" <<EOF

[tool.mutmut]
source_paths = ["hf_diffspec"]
only_mutate = ["hf_diffspec/runtime/$module.py"]
also_copy = ["checkpoints", "examples", "data", "modeling", "trainers"]
pytest_add_cli_args_test_selection = [$selection]
pytest_add_cli_args = ["-x", "-q", "-p", "no:cacheprovider"]
process_isolation = "forkserver"
EOF
    fi
    record seed "$module"
    cd "$work"
    echo "mutating $source_file against $(tests_for "$module") in $work"
    # the whole log is kept (a failing clean run names its test there); a failed run still writes the summary
    nice -n 19 env OMP_NUM_THREADS=1 ./venv/bin/python -m mutmut run --max-children "${MUTMUT_MAX_CHILDREN:-2}" \
        > run.log 2>&1 || echo "mutmut stopped early: see $work/run.log" >&2
    ./venv/bin/python -m mutmut results --all true > results.txt 2>&1 || true
    awk -F': ' 'NF == 2 {n[$2]++} END {for (s in n) print s ": " n[s]}' results.txt | sort > summary.txt
    : > survivors.txt
    for mutant in $(awk -F': ' '$2 == "survived" {print $1}' results.txt); do
        ./venv/bin/python -m mutmut show "$mutant" >> survivors.txt 2>&1 || true
        echo >> survivors.txt
    done
    echo "$module: $(tr '\n' ' ' < summary.txt)"
    cd "$ROOT"
    record save "$module"
done
