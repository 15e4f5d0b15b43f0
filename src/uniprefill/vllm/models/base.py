"""What every UniPrefill model class adds to vLLM's: the forward of a dropping step.

A step in which no row drops (decode, short prompts, chunk continuations) runs
vLLM's own forward: compiled, with CUDA graphs. A dropping step runs the layers in
segments between gather points (``uniprefill.vllm.segments``), compiled when vLLM
compiles: the drop layer's attention scores q/k as it runs (its backend's
``forward`` is wrapped), and between segments the runtime gathers hidden states,
residual and positions, so the drop layer's MLP and every later layer see only the
kept tokens.
"""

from __future__ import annotations

import functools
import logging
import time
from typing import TYPE_CHECKING, Any

import torch

from uniprefill.config import uniprefill_config
from uniprefill.vllm.families import ModelFamily
from uniprefill.vllm.lora import LoRATokenMapping, check_lora_settings
from uniprefill.vllm.runtime import UniPrefillRuntime
from uniprefill.vllm.segments import Segment, SegmentFn, build_segments, compile_segment
from uniprefill.vllm.stash import stash_reserve_bytes
from uniprefill.vllm.step import carry_width, compaction_reserve_bytes

if TYPE_CHECKING:  # vLLM's types, named so a type checker flags a renamed attribute
    from vllm.config import VllmConfig
    from vllm.model_executor.layers.attention import Attention
    from vllm.v1.kv_cache_interface import KVCacheSpec

    from uniprefill.vllm.model_state import UniPrefillStateMixin

logger = logging.getLogger("vllm.uniprefill")

# The walk's state in the intermediate tensors a pipeline rank sends the next one.
CARRY_KEY = "uniprefill_walk"


def is_draft_model(vllm_config: VllmConfig) -> bool:
    """Whether this model is speculative decoding's separate draft model (method
    "draft_model"), loaded with the target's config but its own model config."""
    spec = vllm_config.speculative_config
    return (
        spec is not None
        and spec.method == "draft_model"
        and vllm_config.model_config is spec.draft_model_config
        and spec.draft_model_config is not spec.target_model_config
    )


class UniPrefillModel:
    """Mixed in before vLLM's ``*ForCausalLM`` class of a supported family."""

    family: ModelFamily  # set by each subclass
    uniprefill: UniPrefillRuntime | None = None
    # The V2 runner's model state (UniPrefill's): builds each later stage's metadata.
    uniprefill_state: UniPrefillStateMixin | None = None

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "", **kwargs: Any) -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix, **kwargs)  # type: ignore[call-arg]
        self.uniprefill_vllm_config = vllm_config
        cfg = uniprefill_config(vllm_config.additional_config)
        if cfg is not None and is_draft_model(vllm_config):
            cfg = None  # a separate draft model drafts densely (docs/usage.md)
        self.uniprefill_config = cfg
        if cfg is None:
            # vLLM keeps a registered override for the rest of the process: a later
            # engine without UniPrefill, or a draft model of the target's family, gets
            # this class, which then is vLLM's own.
            return
        hf_config = vllm_config.model_config.hf_config
        self.drop_layers = self.family.resolve_drop_layers(hf_config, cfg.drop_layers)
        cfg.check_schedule(self.drop_layers)
        self._dropping = False
        self._max_tokens = vllm_config.scheduler_config.max_num_batched_tokens
        # LoRA: vLLM's token-to-adapter mapping is set per step and re-set at each gather
        # point of a dropping step (uniprefill.vllm.lora), bound at the first one.
        self._uses_lora = vllm_config.lora_config is not None
        self._lora_mapping: LoRATokenMapping | None = None
        if self._uses_lora:
            check_lora_settings(cfg)
        layers = self.model.layers  # type: ignore[attr-defined]
        # Pipeline parallelism: this rank runs layers [start, end) (vLLM's PPMissingLayer
        # elsewhere) and the drop layers among them; the walk enters at `_first_stage`.
        inner = self.model  # type: ignore[attr-defined]
        start, end = getattr(inner, "start_layer", 0), getattr(inner, "end_layer", len(layers))
        self._pp = vllm_config.parallel_config.pipeline_parallel_size > 1
        self._pp_last = end == len(layers)
        self._local_drops = tuple(d for d in self.drop_layers if start <= d < end)
        self._first_stage = sum(1 for d in self.drop_layers if d < start)
        self._carry_unset: torch.Tensor | None = None
        if self._pp:
            self._vllm_make_empty_intermediate_tensors = self.make_empty_intermediate_tensors
            self.make_empty_intermediate_tensors = self._make_empty_intermediate_tensors
        mst = cfg.max_stash_tokens
        if mst is None:  # no stash with LoRA or across pipeline ranks (both refuse mst > 0)
            no_stash = self._pp or self._uses_lora
            mst = 0 if no_stash else vllm_config.model_config.max_model_len
        self._stash_tokens = mst
        for layer in layers:
            if getattr(layer, "use_attn_reduce_scatter_for_moe", False):
                raise ValueError(
                    "uniprefill: MoE reduce-scatter across tensor-parallel ranks is not "
                    "supported (it splits the token set UniPrefill compacts)"
                )
        fam = self.family
        for d in self._local_drops:
            attention = fam.attention(layers[d])
            # The front end read the layer kinds from the config; vLLM's module decides.
            if getattr(attention, "sliding_window", None) is not None:
                raise ValueError(
                    f"drop_layers: layer {d} of this {fam.family} model runs with a sliding "
                    f"window of {attention.sliding_window} in vLLM; a drop layer must be a "
                    "full-attention layer"
                )
            _score_in_attention(self, d, attention)
        if cfg.free_kv_blocks:
            _report_stage_specs(layers, self.drop_layers, fam, range(start, end))
        # An EAGLE-3 drafter's auxiliary hidden states: the inputs of these layers
        # (vLLM sets them after loading, through set_aux_hidden_state_layers).
        self._aux_layers: tuple[int, ...] = ()
        # Compiled as vLLM's own model is, unless the setting says otherwise (with LoRA:
        # eager, see uniprefill.vllm.lora).
        self._compiled = cfg.compile_drop_steps
        if self._compiled is None:
            from vllm.config.compilation import CompilationMode

            compiles = vllm_config.compilation_config.mode != CompilationMode.NONE
            self._compiled = compiles and not self._uses_lora
        self._set_segments()
        self._segments_warm = not self._compiled

    def _set_segments(self) -> None:
        self._segments = self._build_segments()
        self._segment_fns: list[SegmentFn] = [
            compile_segment(seg, i) if self._compiled else seg.forward
            for i, seg in enumerate(self._segments)
        ]

    def _build_segments(self) -> list[Segment]:
        """This rank's layers in segments between its drop layers (all layers without PP)."""
        fam, inner = self.family, self.model  # type: ignore[attr-defined]
        layers = inner.layers
        start, end = getattr(inner, "start_layer", 0), getattr(inner, "end_layer", len(layers))
        return build_segments(
            layers[:end],
            self._local_drops,
            inner.norm if self._pp_last else None,
            first=start,
            mixer=fam.layout.mixer,
            ffn=fam.layout.ffn,
            ffn_attrs_off=fam.layout.ffn_attrs_off,
            zeroed=fam.layout.zeroed,
            mixer_attrs=fam.layout.mixer_attrs,
            taps=self._aux_layers,
        )

    def set_aux_hidden_state_layers(self, layers: tuple[int, ...]) -> None:
        """vLLM's EAGLE-3 seam (``SupportsEagle3``): dropping steps return these layers'
        inputs too, at every row of the step (zeros at dropped tokens, as the last
        hidden states; docs/usage.md)."""
        super().set_aux_hidden_state_layers(layers)  # type: ignore[misc]
        if self.uniprefill_config is None:
            return
        if self._segments_warm and self._compiled:
            raise RuntimeError("uniprefill: auxiliary layers set after the segments compiled")
        self._aux_layers = tuple(sorted(set(layers)))
        self._set_segments()

    def _lora(self) -> LoRATokenMapping | None:
        """The LoRA token mapping of dropping steps (None without LoRA).

        Bound at the first dropping step: vLLM wraps the model's linear layers for
        LoRA after the model is built, so the segments are built again from the
        wrapped modules (eager with LoRA: nothing compiled is lost).
        """
        if not self._uses_lora or self._lora_mapping is not None:
            return self._lora_mapping
        manager = getattr(self, "lora_manager", None)  # set by vLLM's LoRAModelManager
        if manager is None:
            raise RuntimeError("uniprefill: LoRA is on but vLLM set no lora_manager on the model")
        assert not self._compiled
        self._set_segments()
        self._lora_mapping = LoRATokenMapping(manager, self.model.layers)  # type: ignore[attr-defined]
        return self._lora_mapping

    @property
    def drop_steps_compiled(self) -> bool:
        """Whether steps that drop run their segments compiled (reported in the stats)."""
        return bool(self._compiled)

    # ---- vLLM seams ------------------------------------------------------------------------
    def get_model_state_cls(self) -> type:
        from uniprefill.vllm.model_state import base_state_class, model_state_class

        if self.uniprefill_config is None:
            return base_state_class(self.uniprefill_vllm_config)
        return model_state_class(self.uniprefill_vllm_config)

    def make_uniprefill_runtime(
        self, state: UniPrefillStateMixin, device: torch.device, max_num_reqs: int
    ) -> UniPrefillRuntime:
        """Called by the model state (``state``) once the device is known."""
        self.uniprefill_state = state
        from uniprefill.vllm.worker import log_start, tp_allreduce, warm_up

        rt = UniPrefillRuntime(
            self.uniprefill_config,
            self.drop_layers,
            device,
            max_num_reqs,
            score_allreduce=tp_allreduce(),
            stash_tokens=self._stash_tokens,
        )
        self.uniprefill = rt
        log_start(self, rt)
        warm_up(self, rt, max_num_reqs)
        return rt

    def scoring_attention(self) -> Attention | None:
        """The attention module of this rank's first drop layer (its heads are what the
        selection scores); None on a pipeline rank without one."""
        if not self._local_drops:
            return None
        return self.family.attention(self.model.layers[self._local_drops[0]])  # type: ignore[attr-defined]

    def _make_empty_intermediate_tensors(
        self, batch_size: int, dtype: torch.dtype, device: torch.device
    ) -> Any:
        """vLLM's receive buffers of a pipeline rank after the first, plus the walk's state
        (``step.walk_carry``): vLLM copies every key of these from what the previous rank
        sent, each sliced to the step's padded token count. (vLLM's model classes set
        ``make_empty_intermediate_tensors`` on the instance: ``__init__`` wraps it.)"""
        out = self._vllm_make_empty_intermediate_tensors(batch_size, dtype, device)
        width = carry_width(len(self.drop_layers) + 1)
        out.tensors[CARRY_KEY] = torch.full(
            (batch_size, width), -1, dtype=torch.int64, device=device
        )
        return out

    def _carry_buffer(self, rows: int, device: torch.device) -> torch.Tensor:
        """-1s: what a step that does not drop sends (a persistent buffer)."""
        width = carry_width(len(self.drop_layers) + 1)
        if self._carry_unset is None or self._carry_unset.shape[0] < rows:
            self._carry_unset = torch.full((rows, width), -1, dtype=torch.int64, device=device)
        return self._carry_unset[:rows]

    def _with_carry(self, out: Any, carry: torch.Tensor | None = None) -> Any:
        """A rank before the last sends the walk's state in every step (vLLM's receiver
        copies each key it expects); steps that do not drop send -1s."""
        if self._pp_last:
            return out
        if carry is None:
            rows = out["hidden_states"].shape[0]
            carry = self._carry_buffer(rows, out["hidden_states"].device)
        out.tensors[CARRY_KEY] = carry
        return out

    # ---- forward --------------------------------------------------------------------------
    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors: Any = None,
        inputs_embeds: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> Any:
        from vllm.forward_context import get_forward_context

        dense = functools.partial(
            super().forward,  # type: ignore[misc]
            input_ids,
            positions,
            intermediate_tensors,
            inputs_embeds,
            **kwargs,
        )
        if self.uniprefill_config is None:
            return dense()  # off: vLLM's class as it is (an override outlives its engine)
        rt = self.uniprefill
        fc = get_forward_context()
        if fc.attn_metadata is None:
            return self._with_carry(
                self._dummy_forward(
                    dense, input_ids, positions, inputs_embeds, intermediate_tensors
                )
            )
        step = rt.step if rt is not None else None
        if step is None:
            return self._with_carry(dense())
        if step.slot_overrides:
            fc.slot_mapping.update(step.slot_overrides)
        if not step.dropping:
            return self._with_carry(dense())
        if kwargs:
            raise RuntimeError(f"uniprefill: unsupported model inputs {sorted(kwargs)}")
        return self._dropping_forward(input_ids, positions, inputs_embeds, intermediate_tensors)

    def _dropping_forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        inputs_embeds: Any,
        intermediate_tensors: Any = None,
    ) -> Any:
        rt, inner, state = self.uniprefill, self.model, self.uniprefill_state  # type: ignore[attr-defined]
        assert rt is not None and state is not None
        lora = self._lora()
        if intermediate_tensors is None:
            walk = rt.begin_walk(positions)
            if lora is not None:
                lora.begin(walk.plan.qlen0)
            hidden = (
                inputs_embeds if inputs_embeds is not None else inner.embed_input_ids(input_ids)
            )
            residual = None
        else:  # a pipeline rank after the first
            walk = rt.resume_walk(positions, intermediate_tensors[CARRY_KEY], self._first_stage)
            if lora is not None:  # vLLM mapped the step's tokens; this rank gets the kept
                lora.begin(walk.plan.qlen0)
                lora.follow(walk.qlen)
            kept = walk.positions.shape[-1]
            hidden = intermediate_tensors["hidden_states"][:kept]
            residual = intermediate_tensors["residual"][:kept]
            if walk.stage > 0 and walk.needs_metadata():
                state.stage_metadata(walk)
        self._dropping = True
        aux: list[torch.Tensor] = []  # EAGLE-3's, at the step's rows
        try:
            for run_segment, drop in zip(
                self._segment_fns, (*self._local_drops, None), strict=True
            ):
                hidden, residual, taps = run_segment(walk.positions, hidden, residual)
                aux.extend(rt.at_step_rows(t) for t in taps)
                if drop is not None:  # walk.positions shrinks here; the next stage starts
                    hidden, residual = rt.on_gather_point(drop, hidden, residual)
                    if lora is not None:
                        lora.follow(walk.qlen)
                    if walk.needs_metadata():
                        state.stage_metadata(walk)
        finally:
            self._dropping = False
            if lora is not None:
                lora.end()
        if self._pp_last:
            hidden = rt.finish_forward(hidden)
            return (hidden, aux) if self._aux_layers else hidden
        from vllm.sequence import IntermediateTensors

        assert residual is not None
        hidden, residual, carry = rt.finish_stage(hidden, residual)
        out = IntermediateTensors({"hidden_states": hidden, "residual": residual})
        return self._with_carry(out, carry)

    def _dummy_forward(
        self,
        dense: Any,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        inputs_embeds: Any,
        intermediate_tensors: Any = None,
    ) -> Any:
        """vLLM's dummy runs (memory profile, warm-ups): no attention metadata.

        The memory-profiling run holds what a dropping step needs beyond a dense
        forward (:meth:`_profile_reserve`) while it runs the dense model, then the
        segments at the largest token counts a dropping step gives them; the first
        dummy run compiles the segments the same way.
        """
        reserve = self._profile_reserve(positions)
        try:
            out = dense()
            if reserve is not None or not self._segments_warm:
                self._run_segments(input_ids, positions, inputs_embeds, intermediate_tensors)
            return out
        finally:
            del reserve

    def _run_segments(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        inputs_embeds: Any,
        intermediate_tensors: Any = None,
    ) -> None:
        """Run (and, the first time, compile) the segments, the later ones at their largest.

        Attention without metadata computes nothing (vLLM's dummy runs), so this traces
        and compiles each segment once, for any token count. The first segment gets one
        step's tokens (``max_num_batched_tokens``), the later ones that plus
        ``max_stash_tokens`` (a last chunk brings its prompt's earlier chunks): the most
        a dropping step gives them. Inductor picks 32-bit indexing when the tokens it
        compiles for fit it, and guards on it: compiled for one step's tokens, a later
        segment compiled again, a stall of seconds per segment, the first time a chunked
        prompt kept ~75K tokens or more on the Llama-8B shape. And the memory profile
        holds their activations.
        """
        if positions.shape[-1] < 2:
            return
        t0 = time.perf_counter()
        inner = self.model  # type: ignore[attr-defined]
        residual: torch.Tensor | None = None
        if intermediate_tensors is not None:  # a pipeline rank after the first
            hidden, residual = (
                intermediate_tensors["hidden_states"],
                intermediate_tensors["residual"],
            )
        elif inputs_embeds is not None:
            hidden = inputs_embeds
        else:
            hidden = inner.embed_input_ids(input_ids)
        first_run = not self._segments_warm
        self._segments_warm = True
        positions = positions.clone()  # as in _dropping_forward
        most = self._max_tokens + self._stash_tokens
        try:
            for i, run_segment in enumerate(self._segment_fns):
                tokens = self._max_tokens if i == 0 else most
                if hidden.shape[0] < tokens:
                    hidden = hidden.new_zeros((tokens, *hidden.shape[1:]))
                    if residual is not None:
                        residual = residual.new_zeros((tokens, *residual.shape[1:]))
                    positions = positions.new_zeros((*positions.shape[:-1], tokens))
                hidden, residual, _ = run_segment(positions, hidden, residual)
        except Exception as e:
            if not (first_run and self._compiled):
                raise
            # An engine that runs beats one that stops: eager segments work everywhere.
            self._compiled = False
            self._segment_fns = [seg.forward for seg in self._segments]
            logger.warning(
                "uniprefill: compiling the dropping step failed, dropping steps run eager "
                "(compile_drop_steps=false skips the attempt): %r",
                e,
            )
            return
        logger.info(
            "uniprefill: %d segments of the dropping step %s in %.1f s (later ones at %d tokens)",
            len(self._segment_fns),
            "compiled" if first_run and self._compiled else "run",
            time.perf_counter() - t0,
            most,
        )

    def _profile_reserve(self, positions: torch.Tensor) -> torch.Tensor | None:
        """In vLLM's memory-profiling run, the memory a dropping step needs besides
        activations (None in other dummy runs, and off the GPU).

        vLLM sizes the KV cache from this run's peak; a dropping step's compacted
        copies come on top of a dense forward (seen on the H200: out of memory at
        4 x 64K on Qwen3-Next without this).
        """
        if (
            positions.device.type != "cuda"
            or positions.shape[-1] < self._max_tokens
            or torch.cuda.is_current_stream_capturing()
        ):
            return None
        cfg = self.uniprefill_config
        attn = self.scoring_attention()
        if attn is None:  # a pipeline rank without a drop layer
            return None
        vcfg = self.uniprefill_vllm_config
        hidden_size = vcfg.model_config.get_hidden_size()  # type: ignore[attr-defined]
        act_bytes = torch.empty(0, dtype=vcfg.model_config.dtype).element_size()  # type: ignore[attr-defined]
        nbytes = compaction_reserve_bytes(
            max_tokens=self._max_tokens + self._stash_tokens,
            max_reqs=vcfg.scheduler_config.max_num_seqs,  # type: ignore[attr-defined]
            hidden_size=hidden_size,
            act_bytes=act_bytes,
            num_q_heads=attn.num_heads,
            last_q=cfg.last_q,
        )
        if self._stash_tokens:
            nbytes += stash_reserve_bytes(
                capacity=self._stash_tokens,
                max_tokens=self._max_tokens,
                hidden_size=hidden_size,
                act_bytes=act_bytes,
                num_q_heads=attn.num_heads,
                num_kv_heads=attn.num_kv_heads,
                head_size=attn.head_size,
            )
        return torch.empty(nbytes, dtype=torch.uint8, device=positions.device)


def _report_stage_specs(
    layers: Any, drop_layers: tuple[int, ...], family: ModelFamily, own: range
) -> None:
    """free_kv_blocks: each layer's KV spec names its stage, so stages get groups of their
    own (``own``: this pipeline rank's layers; vLLM's PPMissingLayer elsewhere)."""
    from uniprefill.vllm import kv_specs, patches
    from uniprefill.vllm.stages import stage_of_layer

    kv_specs.register()
    patches.carry_kept_records()  # records to the scheduler, its notices back
    for i in own:
        attention = family.attention(layers[i])
        spec_of = attention.get_kv_cache_spec
        stage = stage_of_layer(i, drop_layers)

        def get_kv_cache_spec(
            vllm_config: VllmConfig, spec_of: Any = spec_of, stage: int = stage
        ) -> KVCacheSpec:
            return kv_specs.stage_spec(spec_of(vllm_config), stage)

        attention.get_kv_cache_spec = get_kv_cache_spec


def _score_in_attention(model: UniPrefillModel, layer_idx: int, attention: Attention) -> None:
    """Score q/k at a drop layer inside its attention backend's ``forward``.

    The backend runs outside any compiled graph (vLLM calls it from an opaque
    custom op, in eager and compiled models alike), so it sees the post-RoPE q/k of
    every dropping step; in other steps, and while a graph is traced or captured,
    it only passes through. The wrapper shadows ``forward`` on this layer's
    backend instance (catalogued in ``patches.py``).
    """
    impl = attention.impl
    backend_forward = impl.forward

    def forward(layer: Any, query: torch.Tensor, key: torch.Tensor, *args: Any, **kwargs: Any):
        if model._dropping and not torch.compiler.is_compiling():
            assert model.uniprefill is not None
            model.uniprefill.on_attention_input(
                layer_idx,
                query,
                key,
                layer.num_heads,
                layer.num_kv_heads,
                layer.head_size,
                float(impl.scale),
            )
        return backend_forward(layer, query, key, *args, **kwargs)

    impl.forward = forward
