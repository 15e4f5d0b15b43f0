# Sourced by the device scripts (run_ttft.sh, prepare_model.sh, calibrate_own.sh) from
# the repo root: vLLM's dependency wheels installed once per lease, the plugin's entry
# point made visible, PYTHONPATH and the offline settings exported.
# .carry/deps3 holds loguru (compressed-tensors needs it; Qwen3-Next imports that).
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
if [[ ! -d /tmp/site1 ]]; then
  t0=$(date +%s)
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site1 \
    .carry/deps/*.whl $(ls .carry/deps3/*.whl 2>/dev/null) || { echo "deps install failed"; exit 3; }
  echo "deps installed in $(( $(date +%s) - t0 )) s"
fi
# vLLM finds plugins through entry points: a minimal dist-info on PYTHONPATH declares
# ours (the source itself is imported from ./src).
di=/tmp/upsite/uniprefill-0.1.0.dist-info
mkdir -p "$di"
printf 'Metadata-Version: 2.1\nName: uniprefill\nVersion: 0.1.0\n' > "$di/METADATA"
printf '[vllm.general_plugins]\nuniprefill = uniprefill.vllm.plugin:register\n' \
  > "$di/entry_points.txt"
# /tmp/site4: gguf and accelerate for the trained model's conversion (prepare_model.sh)
export PYTHONPATH=/tmp/site4:/tmp/site2:/tmp/site1:/tmp/site:/tmp/upsite:$PWD/src
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 VLLM_ALLOW_INSECURE_SERIALIZATION=1
python3 - <<'PY' || exit 4
import importlib.metadata as m, vllm
eps = [e.value for e in m.entry_points(group="vllm.general_plugins")]
print("vllm", vllm.__version__, "plugins", eps)
assert "uniprefill.vllm.plugin:register" in eps
PY
