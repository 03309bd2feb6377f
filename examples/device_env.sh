# Sourced by what runs on a lent device machine (examples/gpu_check.sh, examples/drafter_campaign.sh run):
#   . examples/device_env.sh && device_env WHEELS_DIR
# When WHEELS_DIR holds wheels (carried there: `bash examples/device_slim.sh wheels`), they and this project are
# installed into a private folder put first on PYTHONPATH and PATH; the image's own packages stay as they are. Without
# them nothing changes. Why: a GPU image holds PyTorch and an older transformers (5.17 on the H200 image, 2026-11),
# with which the decoding loop fails (its hidden states come back indexed differently); huggingface_hub stays the
# image's (the carried transformers 5.24 takes >= 1.31; hub 2.x, which 5.25 requires, would need httpx2, which such
# an image lacks).
device_env() {
    local wheels=$1 root site
    root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
    compgen -G "$wheels/*.whl" >/dev/null || return 0
    site=${DEVICE_SITE:-/tmp/hf-diffspec-site}
    python -m pip install -q --no-index --no-deps --no-build-isolation --upgrade --target "$site" \
        "$wheels"/*.whl "$root"
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" PATH="$site/bin:$PATH"
    # from the site: run from the repository's root, `python -c` would find its source folder first
    (cd "$site" && python -c "import transformers, hf_diffspec
print('device_env: hf_diffspec and transformers', transformers.__version__, 'from', hf_diffspec.__file__.rsplit('/', 2)[0])")
}
