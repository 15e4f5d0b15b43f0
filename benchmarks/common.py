"""Shared helpers of the GPU benchmarks: model shapes, model folders, engines, logging.

The models are randomly initialised (vLLM's dummy loader) in the shapes of real
checkpoints; only ``config.json`` and a tiny tokenizer are written.
"""

from __future__ import annotations

import gc
import json
import random
import re
import subprocess
import time
from pathlib import Path
from typing import Any

from uniprefill.cpu_triton import enable as _enable_cpu_triton
from uniprefill.vllm.families import FAMILIES, early, family_named

# Before anything imports vLLM: on a CPU machine (the --smoke-cpu runs) vLLM's V2
# runner needs Triton's interpreter; on a GPU this does nothing.
_enable_cpu_triton()

KB = 1024

# ---- model shapes ---------------------------------------------------------------------------
# name -> family, default budget and drop layers (None: the family default), from the
# family registry's benchmark shapes (uniprefill.vllm.families), plus the CPU smoke model.
MODELS: dict[str, dict[str, Any]] = {
    name: {
        "family": f.family,
        "budget_tokens": s.budget_tokens,
        "drop_layers": None if s.drop_layers is None else list(s.drop_layers),
    }
    for f in FAMILIES
    for name, s in f.shapes.items()
}
# CPU smoke test: tiny shapes, same code path.
MODELS["tiny-llama"] = {"family": "llama", "budget_tokens": 4 * KB, "drop_layers": None}


def hf_config(name: str, max_pos: int) -> Any:
    """The transformers config of ``name`` (no weights)."""
    import transformers

    if name == "tiny-llama":
        from uniprefill.testing.tiny_models import tiny_config

        return tiny_config("llama", max_position_embeddings=max(max_pos, 4096))
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; choose from {sorted(MODELS)}")
    family = family_named(MODELS[name]["family"])
    shape = family.shapes[name]
    kw = {**shape.config, "max_position_embeddings": max(max_pos, shape.min_max_position)}
    if shape.layer_pattern:
        n, pattern = kw["num_hidden_layers"], shape.layer_pattern
        kw["layer_types"] = [pattern[i % len(pattern)] for i in range(n)]
    cfg = getattr(transformers, family.tiny.config_class)(**kw)
    cfg.architectures = [next(iter(family.architectures))]
    return cfg


def model_drop_layers(name: str, choice: str | list[int]) -> list[int] | None:
    """The drop layers a benchmark runs ``name`` at: ``choice`` is "" (the shape's
    default; None: the family's), "early" (``families.early`` on the shape) or a list."""
    if choice == "":
        return MODELS[name]["drop_layers"]
    if choice == "early":
        family = family_named(MODELS[name]["family"])
        return list(early(family.types_for(hf_config(name, 0))))
    return list(choice)


def build_model_dir(
    name: str, root: Path, max_pos: int, dtype: str, num_layers: int | None = None
) -> Path:
    """config.json + tokenizer only; vLLM's dummy loader makes the weights.

    ``num_layers`` keeps the first layers of the shape (faster start-up for checks).
    """
    from uniprefill.testing.tiny_models import build_tiny_tokenizer

    out = root / (name if num_layers is None else f"{name}-{num_layers}l")
    out.mkdir(parents=True, exist_ok=True)
    cfg = hf_config(name, max_pos)
    if num_layers is not None:
        cfg.num_hidden_layers = num_layers
        if getattr(cfg, "layer_types", None):
            cfg.layer_types = cfg.layer_types[:num_layers]
    cfg.dtype = dtype
    cfg.save_pretrained(str(out))
    if not (out / "tokenizer.json").exists():
        build_tiny_tokenizer(out)
    return out


LOG_PREFIX = ["bench"]


def log(msg: str) -> None:
    print(f"[{LOG_PREFIX[0]} {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def gpu_used_mib() -> int | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        return int(out.stdout.split()[0])
    except Exception:
        return None


def wait_gpu_free(limit_mib: int = 4000, timeout_s: float = 60.0) -> None:
    t0 = time.time()
    while time.time() - t0 < timeout_s:
        used = gpu_used_mib()
        if used is None or used < limit_mib:
            return
        time.sleep(1.0)
    log(f"warning: GPU still holds {gpu_used_mib()} MiB after {timeout_s:.0f} s")


def random_prompts(lengths: list[int], seed: int, shuffle: bool = False) -> list[dict[str, Any]]:
    """Prompts of random token ids, one per length (in a seeded random order with
    ``shuffle``): the same seed gives the same prompts in every script."""
    rng = random.Random(seed)
    lengths = list(lengths)
    if shuffle:
        rng.shuffle(lengths)
    # ids 5..999: inside the tiny tokenizer's vocab (1024) and every model's.
    return [{"prompt_token_ids": [rng.randrange(5, 1000) for _ in range(n)]} for n in lengths]


def batch_prompts(length: int, conc: int, seed: int) -> list[dict[str, Any]]:
    """``conc`` random prompts of ``length`` tokens."""
    return random_prompts([length] * conc, seed)


# ---- modes: how a benchmark names the plugin's selection settings ----------------------------
_RATIO = r"(0?\.\d+|1(\.0*)?)"
_MODE = re.compile(rf"^(dense|topp{_RATIO}|own{_RATIO}|keep{_RATIO}(/{_RATIO})*)$")

# {prompt length: {top_p: kept share per drop layer}}, from `uniprefill calibrate` JSONs.
OwnShares = dict[int, dict[float, list[float]]]


def load_own_shares(paths: list[str], schedule: list[int] | None = None) -> OwnShares:
    """The kept share per drop layer that a trained model's own attention kept, per
    measured prompt length and top_p: ``uniprefill calibrate`` JSONs, one length each
    (calibrate averages over its lengths, so a file of several would mix them). A file
    that compares schedules (``--schedule``) gives the runs at ``schedule`` (the
    measured model's drop layers), which must then be named."""
    own: OwnShares = {}
    for path in paths:
        doc = json.loads(Path(path).read_text())
        lengths = doc["prompts"]["lengths"]
        if len(lengths) != 1:
            raise ValueError(f"--own-shares {path}: {len(lengths)} lengths; one per file")
        if lengths[0] in own:
            raise ValueError(f"--own-shares: two files measured length {lengths[0]}")
        configs = doc["configs"]
        if any(c.get("schedule") for c in configs):
            if schedule is None:
                raise ValueError(
                    f"--own-shares {path}: compares schedules (--schedule); name the "
                    "measured one to replay with --own-drop-layers"
                )
            configs = [c for c in configs if list(c["drop_layers"]) == list(schedule)]
            if not configs:
                raise ValueError(f"--own-shares {path}: no run at drop layers {schedule}")
        own[lengths[0]] = {c["top_p"]: c["kept_per_layer"] for c in configs}
    return own


def own_shares_at(own: OwnShares, top_p: float, length: int) -> tuple[int, list[float]]:
    """The measured length replayed at ``length`` (the longest measured one not longer,
    else the shortest: longer prompts keep less, so this understates their drop) and its
    shares at ``top_p``."""
    measured = max((n for n in own if n <= length), default=min(own))
    if top_p not in own[measured]:
        raise ValueError(
            f"own{top_p:g}: top_p {top_p:g} not measured at length {measured} "
            f"(measured: {sorted(own[measured])})"
        )
    return measured, own[measured][top_p]


def mode_options(
    mode: str, length: int | None = None, own: OwnShares | None = None
) -> dict[str, Any]:
    """The uniprefill options of a mode name: ``dense`` (top_p 1, the plugin's dense
    path), ``topp<P>`` (top_p P), ``keep<R>`` (keep_ratio R, top_p 0.99),
    ``keep<R1>/<R2>/...`` (one keep ratio per drop layer), or ``own<P>``: the kept
    shares a trained model's own attention kept at top_p P (``own``, from
    ``--own-shares``), replayed as one keep ratio per drop layer at ``length``."""
    if not _MODE.match(mode):
        raise ValueError(
            f"bad mode {mode!r}: use dense, topp<P> (topp0.99), keep<R> (keep0.3), "
            "keep<R1>/<R2>/... (one ratio per drop layer) or own<P> (with --own-shares)"
        )
    if mode == "dense":
        return {"top_p": 1.0, "keep_ratio": None}
    if mode.startswith("topp"):
        return {"top_p": float(mode[4:]), "keep_ratio": None}
    if mode.startswith("own"):
        if not own:
            raise ValueError(f"mode {mode!r} needs --own-shares (calibrate JSON files)")
        _, shares = own_shares_at(own, float(mode[3:]), length if length else max(own))
        return {"top_p": 0.99, "keep_ratio": list(shares)}
    ratios = [float(r) for r in mode[4:].split("/")]
    return {"top_p": 0.99, "keep_ratio": ratios[0] if len(ratios) == 1 else ratios}


def replayed(modes: list[str], lengths: list[int], own: OwnShares | None) -> dict[str, Any]:
    """For the JSON: which measured length and shares each ``own<P>`` mode replays at
    each benchmark length."""
    out: dict[str, Any] = {}
    for mode in modes:
        if mode.startswith("own") and own:
            out[mode] = {}
            for n in lengths:
                measured, shares = own_shares_at(own, float(mode[3:]), n)
                out[mode][str(n)] = {"measured_length": measured, "kept_per_layer": shares}
    return out


def add_own_shares_arg(p: Any) -> None:
    p.add_argument(
        "--own-shares",
        default="",
        help="comma-separated `uniprefill calibrate` JSON files (one prompt length each) "
        "whose kept shares the own<P> modes replay",
    )
    p.add_argument(
        "--own-drop-layers",
        default="",
        help="with --own-shares files that compare schedules: the measured model's drop "
        "layers whose shares to replay (e.g. 2,5,8,12,16,20)",
    )


def parse_modes(
    p: Any, modes: list[str], own_paths: str, own_drop_layers: str = ""
) -> OwnShares | None:
    """Load ``--own-shares`` and check every mode early (``p.error`` names the bad one)."""
    try:
        schedule = [int(x) for x in own_drop_layers.split(",") if x.strip()] or None
        paths = [x for x in own_paths.split(",") if x]
        own = load_own_shares(paths, schedule) if own_paths else None
        for m in modes:
            mode_options(m, None, own)
    except (ValueError, OSError, KeyError) as e:
        p.error(str(e))
    return own


def close_llm(llm: Any) -> None:
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception as e:  # noqa: BLE001
        log(f"shutdown: {e!r}")
    del llm
    gc.collect()
